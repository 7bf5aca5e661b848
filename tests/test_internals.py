"""The private names of PyTorch and Python that the scripts use are reached only in the files
PLACES names, and each exists on the installed PyTorch: an upgrade that renames one fails here,
not in a user's run. Where one is missing all the same, the stall line still comes, naming no rank
rather than a wrong one."""

from __future__ import annotations

import importlib
import sys
import importlib.util
import multiprocessing.forkserver
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import utils
from extras import checkpoints, checks, stalls
from processes import ROOT

SCRIPTS = sorted(
    path.name for path in ROOT.glob("*.py") if path.name.startswith(("distributed", "dataparallel"))
)
# what reaches into PyTorch's or multiprocessing's insides
PRIVATE = re.compile(
    r"torch\._C\b|\._world\b|_get_default_store|_sequence_number|\._spec\b|\._scale\b|"
    r"ensure_running|_try_get_data|_worker_loop|_dump_nccl_trace|_pytree|_composable|"
    r"queue_callback|_count_flops|_execution_engine"
)
# the only files that reach them, each for what it does: the tree utilities, the watchdog's reads of
# a stalled rank, a shard's host copy, the forkserver's start, the backward's end, the start-up
# step's FLOPs, the skipped fp16 steps, FSDP's activation checkpointing
PLACES = [
    "utils.py",
    "extras/stalls.py",
    "extras/checkpoints.py",
    "extras/workers.py",
    "extras/profiles.py",
    "extras/checks.py",
    "distributed_amp.py",
    "distributed_fsdp.py",
]


def test_each_internal_exists_on_the_installed_pytorch():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        before = stalls.collectives_started()
        dist.all_reduce(torch.ones(1))
        assert before is not None and stalls.collectives_started() == before + 1
        assert isinstance(stalls.default_store(), dist.Store)
        # a shard's host copy, in its place for dcp.save
        shard = distribute_tensor(torch.ones(4), init_device_mesh("cpu", (1,)), [Shard(0)])
        copy = checkpoints.dtensor_of(torch.zeros(4), shard)
        assert isinstance(copy, DTensor) and copy.placements == shard.placements
        assert torch.equal(copy.to_local(), torch.zeros(4))
    finally:
        dist.destroy_process_group()
    if dist.is_nccl_available():  # a CUDA build: the Flight Recorder's dump
        assert callable(torch._C._distributed_c10d._dump_nccl_trace)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    assert isinstance(scaler._scale, torch.Tensor) and scaler._device == "cpu"  # distributed_amp.py
    # the backward's end (extras/profiles.py), a FLOP count's parts (extras/checks.py)
    assert callable(torch.autograd.Variable._execution_engine.queue_callback)
    from torch.utils.flop_counter import FlopCounterMode

    assert callable(FlopCounterMode._count_flops)
    assert callable(multiprocessing.forkserver.ensure_running)
    assert callable(utils.tree_map_only) and callable(utils.tree_flatten)
    assert callable(importlib.import_module("torch.distributed._composable").checkpoint)
    from torch.utils.data import _utils, dataloader

    assert callable(getattr(dataloader._MultiProcessingDataLoaderIter, stalls.DATALOADER_WAIT))
    assert callable(getattr(_utils.worker, stalls.WORKER_LOOP))
    for name in ("torch._dynamo.convert_frame", "torch._inductor.compile_fx"):
        module = importlib.import_module(name)
        assert stalls.COMPILE_FILES.search(module.__file__.replace("\\", "/")), module.__file__


def test_internals_are_reached_only_where_places_says():
    paths = [ROOT / name for name in (*SCRIPTS, "utils.py")] + sorted(
        (ROOT / "extras").glob("*.py")
    )
    reaching = set()
    for path in paths:
        lines = [
            line
            for line in path.read_text().splitlines()
            if PRIVATE.search(line) and not line.lstrip().startswith("#")
        ]
        if lines:
            reaching.add(path.relative_to(ROOT).as_posix())
    assert reaching <= set(PLACES), sorted(reaching - set(PLACES))


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_default_loss_is_recognised_in_every_script(script, monkeypatch):
    """The label check before training runs for the default loss alone (a user's may ignore labels)."""
    spec = importlib.util.spec_from_file_location(Path(script).stem, ROOT / script)
    module = importlib.util.module_from_spec(spec)
    # registered, as an import registers it: a dataclass of the script looks its module up
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    assert checks.is_default_loss(module.compute_loss)


def test_without_collective_counts_the_line_names_no_rank_but_every_position(monkeypatch, tmp_path):
    monkeypatch.delattr(dist.distributed_c10d, "_world")
    assert stalls.collectives_started() is None
    reports = [
        {
            "rank": 0,
            "seconds": 25,
            "collectives": None,
            "position": "at step 3 of epoch 1",
            "where": "in main (distributed.py:10)",
            "saving": None,
        },
        {
            "rank": 1,
            "seconds": 21,
            "collectives": None,
            "position": "at step 3 of epoch 1",
            "where": "in compute_loss (distributed.py:50)",
            "saving": None,
        },
    ]
    line = stalls.stall_line(reports, 2, 20, tmp_path)
    assert line == (
        "error: the stalled rank is unknown (PyTorch's collective counts are missing): "
        "rank 0 made no progress for 25 s at step 3 of epoch 1, in main (distributed.py:10); "
        "rank 1 made no progress for 21 s at step 3 of epoch 1, in compute_loss (distributed.py:50); "
        f"every rank's stacks in {tmp_path}/"
    )


def test_a_missing_or_failing_trace_dump_never_stops_the_line(monkeypatch):
    monkeypatch.delattr(torch._C._distributed_c10d, "_dump_nccl_trace", raising=False)
    assert stalls.nccl_trace() is None
    monkeypatch.setattr(
        torch._C._distributed_c10d, "_dump_nccl_trace", lambda: 1 / 0, raising=False
    )
    assert stalls.nccl_trace() is None
    monkeypatch.delattr(dist.distributed_c10d, "_get_default_store")
    assert stalls.default_store() is None
