"""Every private name of PyTorch or Python's multiprocessing that the scripts and this folder use,
in one place. tests/test_internals.py checks that each exists on the installed PyTorch, so an
upgrade that renames one fails that test, not a user's run; where one is missing all the same, what
it serves says so (the stall line names no rank) instead of going wrong.
"""

from __future__ import annotations

import multiprocessing.forkserver
import os
import re

import torch
import torch.distributed as dist
import torch.nn as nn

# Nested tuples, lists and dicts of tensors, mapped and flattened: PyTorch's own tree utilities,
# which torch.compile and FSDP use too.
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten  # noqa: F401

# The frame of a DataLoader waiting for a worker, and of a worker's loop.
DATALOADER_WAIT = "_try_get_data"


WORKER_LOOP = "_worker_loop"


# The files of a compile (not torch._dynamo's disable wrapper, which much of torch runs through).
COMPILE_FILES = re.compile(r"torch/_dynamo/convert_frame\.py|torch/_inductor/")


def collectives_started() -> int | None:
    """The collectives this rank has started in all its groups (the rank with fewest is the one the
    others wait for), or None where PyTorch no longer tells."""
    try:
        groups = dist.distributed_c10d._world.pg_map
        return sum(group._get_sequence_number_for_group() for group in groups)
    except (AttributeError, RuntimeError):
        return None


def default_store() -> dist.Store | None:
    """The store the default process group met in, or None where PyTorch no longer tells."""
    get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get_store is None:
        return None
    return get_store()


def nccl_trace() -> bytes | None:
    """NCCL's Flight Recorder trace of this rank's last collectives, or None."""
    try:
        return torch._C._distributed_c10d._dump_nccl_trace()
    except Exception:  # missing, or failing: the stall line must come all the same
        return None


def dtensor_of(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A DTensor of local (a host copy of like's shard) with like's placement on like's mesh: what
    DCP's own staging for async_save builds, for dcp.save to write. DTensor.from_local would move
    it to the mesh's device."""
    return type(like)(local, like._spec, requires_grad=False)


def checkpoint_activations(module: nn.Module) -> None:
    """Recompute module's activations in backward: FSDP2's composable checkpoint, hooks rather than
    a wrapper module, so that the state dict's keys stay plain."""
    from torch.distributed._composable import checkpoint

    checkpoint(module)


def loss_scale(scaler: torch.amp.GradScaler) -> torch.Tensor:
    """A GradScaler's scale as a tensor on the device (get_scale() would wait for the device); its
    first scale before its first scale()."""
    if scaler._scale is None:
        return torch.full((), scaler.get_scale(), device=scaler._device)
    return scaler._scale


def start_forkserver(folders: list[str]) -> None:
    """Start multiprocessing's forkserver now (and its resource tracker), finding the modules it
    preloads in folders."""
    # It reads PYTHONPATH, not sys.path, whatever the working directory. A rank that ends at once
    # (an error, a stall) leaves its workers' named semaphores to the resource tracker, which frees
    # them and would warn about each on stderr: the two processes alone start with that warning
    # off, and this process's environment is as it was after.
    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", "PYTHONWARNINGS")}
    path, warnings = saved["PYTHONPATH"], saved["PYTHONWARNINGS"]
    os.environ["PYTHONPATH"] = os.pathsep.join([*folders, *([path] if path else [])])
    quiet = "ignore:resource_tracker"
    os.environ["PYTHONWARNINGS"] = ",".join([*([warnings] if warnings else []), quiet])
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value
