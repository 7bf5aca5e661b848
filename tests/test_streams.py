"""Data that streams: build_datasets returns IterableDatasets (no __len__, no indexing), and every script trains on
them as 1 process with the whole batch does, whatever the processes and DataLoader workers; a stream that ends
sooner on one rank ends the epoch on all after the same step; validation counts each sample once; a run stopped
mid-epoch continues exactly, on 2 processes or on 1; what cannot work ends in one line."""

from __future__ import annotations

import argparse
import io
import json
import re
import shutil
import tarfile
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import utils
from extras import streams
from processes import (
    ROOT,
    assert_same_records,
    ends_every_rank_with,
    finish,
    max_weight_difference,
    metrics,
    run_parallel,
    start,
    steps,
)
from projects import COMMON, copy_with_your_functions, launch, users_code

YOUR_STREAM = '''
import os
import signal

import numpy as np


class BlobStream(torch.utils.data.IterableDataset):
    """Blobs read as they come: no __len__ (unless LENGTH is set), no indexing; a new order each epoch (set_epoch);
    noise from a NumPy Generator of its own, as it yields. uneven: rank 1's stream goes on EXTRA_ON_RANK_1 samples
    longer, as a stream of other files might."""

    def __init__(self, size, seed, uneven=False):
        generator = torch.Generator().manual_seed(seed)
        centres = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
        self.labels = torch.randint(0, 4, (size,), generator=generator)
        self.inputs = centres[self.labels] + 1.5 * torch.randn(size, 1, 8, 8, generator=generator)
        self.seed, self.epoch, self.uneven = seed, 0, uneven
        self.rng = np.random.default_rng(seed)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(len(self.labels), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        extra = int(os.environ.get("EXTRA_ON_RANK_1", 0)) if self.uneven and os.environ.get("RANK") == "1" else 0
        for i in order.tolist() + order[:extra].tolist():
            noise = torch.from_numpy(self.rng.normal(scale=0.3, size=(1, 8, 8)).astype("float32"))
            yield self.inputs[i] + noise, int(self.labels[i])


class SizedBlobStream(BlobStream):
    def __len__(self):
        return len(self.labels)


class StoppedAt(nn.Sequential):
    """Rank 0 sends itself SIGTERM (a preemption) in its training forward TERM_AT_FORWARD, if set."""
    forwards = 0

    def forward(self, x):
        self.forwards += self.training
        if self.forwards == int(os.environ.get("TERM_AT_FORWARD", 0)) and os.environ.get("RANK", "0") == "0":
            os.kill(os.getpid(), signal.SIGTERM)
        return super().forward(x)


def build_datasets(args):  # 203: an odd count, whose last global batch rank 1 gets nothing of
    size = int(os.environ.get("TRAIN_SIZE", 640))
    stream = SizedBlobStream if os.environ.get("LENGTH") else BlobStream
    return stream(size, seed=1, uneven=True), stream(203, seed=2), 4


def build_model(args, num_classes):
    return StoppedAt(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, num_classes))


def compute_loss(outputs, targets):
    return F.cross_entropy(outputs, targets)
'''

# 640 samples: 20 global batches of 32, fewer than the 25 steps planned: each epoch ends when the stream does
STREAM = [*COMMON, "--steps-per-epoch", "25", "--print-freq", "6", "--eval-every", "8"]
UNEVEN = {"EXTRA_ON_RANK_1": "48"}  # rank 1 could take a 21st step; rank 0 has none
TERM_IN_EPOCH_2_STEP_7 = str(
    1 + 20 + 7
)  # the start-up check's forward, epoch 1's 20, then epoch 2's


def command(script: str, base, name: str, processes: int, *flags) -> list:
    """The user's stream code in a copy of script, trained into base/name."""
    copy = copy_with_your_functions(script, base / f"copy-{script}", YOUR_STREAM)
    return launch(copy, processes, *STREAM, *flags, "--output-dir", base / name)


# (script, processes, flags, equal to the reference within), run against the stream of rank 1 being longer
SCRIPTS = {
    "dataparallel.py": ("dataparallel.py", 1, ["--workers", "2"], 1e-6),
    "distributed_mp.py": ("distributed_mp.py", 2, [], 1e-5),
    "distributed_grad_accum.py": (
        "distributed_grad_accum.py",
        2,
        ["--accum-steps", "2", "--workers", "1"],
        1e-5,
    ),
    "distributed_fsdp.py": ("distributed_fsdp.py", 2, [], 1e-5),
    "distributed_amp.py": (
        "distributed_amp.py",
        2,
        ["--amp-dtype", "bfloat16"],
        None,
    ),  # other arithmetic: learns
    # one inner step, the outer step to the copies' mean: DDP's steps
    "distributed_diloco.py": (
        "distributed_diloco.py",
        2,
        ["--inner-steps", "1", "--outer-lr", "1", "--outer-momentum", "0"],
        1e-5,
    ),
}


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    """Every stream run, all at once (independent runs share the 2 cores better than in turn): the reference, 1
    process without workers; "two", 2 processes with 2 DataLoader workers each and rank 1's stream longer; "stopped",
    the same stopped by SIGTERM on rank 0 in epoch 2's step 7; and each other script. Their finished processes."""
    base = tmp_path_factory.mktemp("streams")
    runs = {
        "one": ("distributed.py", 1, [], {}),
        "two": ("distributed.py", 2, ["--workers", "2"], UNEVEN),
        "stopped": (
            "distributed.py",
            2,
            ["--workers", "2"],
            {**UNEVEN, "TERM_AT_FORWARD": TERM_IN_EPOCH_2_STEP_7},
        ),
        **{
            name: (script, processes, flags, UNEVEN)
            for name, (script, processes, flags, _) in SCRIPTS.items()
        },
    }
    results = run_parallel(
        [
            (command(script, base, name, processes, *flags), env)
            for name, (script, processes, flags, env) in runs.items()
        ],
        timeout=400,
        cwd=base,
        check=False,
    )  # no hang at an uneven end
    return base, dict(zip(runs, results))


def assert_trained_as_the_reference(out, reference, tolerance: float) -> None:
    # DiLoCo's grad_norm is rank 0's own gradients', not their mean's: the rest as DDP's
    local = (
        {"grad_norm"}
        if (Path(out) / "checkpoint.pt").exists()
        and "replicas" in torch.load(Path(out) / "checkpoint.pt", weights_only=True)
        else set()
    )
    records = (
        [{k: v for k, v in r.items() if k not in local} for r in steps(run)]
        for run in (out, reference)
    )
    assert_same_records(*records, tolerance)
    assert max_weight_difference(out, reference) <= tolerance  # FSDP's: its model.pt


def succeeded(streamed, name: str):
    base, results = streamed
    assert results[name].returncode == 0, results[name].stderr
    return base / name


def test_two_processes_with_workers_and_uneven_ends_train_what_one_process_does(streamed):
    two, one = succeeded(streamed, "two"), succeeded(streamed, "one")
    records = steps(two)
    assert [r["step"] for r in records if r["epoch"] == 1] == [
        6,
        8,
        12,
        16,
        18,
        20,
        25,
    ]  # 20 steps of the 25 planned
    assert_trained_as_the_reference(two, one, 1e-5)
    assert {r["val_images"] for r in records if "val_images" in r} == {
        203
    }  # each sample once, over both ranks
    assert metrics(two)[-1]["val_acc"] > 0.9
    # set_epoch reached the persistent workers: the epochs' losses differ as the reference's do (a new order each)
    assert len({round(m["train_loss"], 6) for m in metrics(one)}) == 3


@pytest.mark.parametrize("case", SCRIPTS)
def test_a_stream_trains_in_every_script(case, streamed):
    out, tolerance = succeeded(streamed, case), SCRIPTS[case][3]
    assert {r["val_images"] for r in steps(out) if "val_images" in r} == {203}
    if tolerance:
        assert_trained_as_the_reference(out, succeeded(streamed, "one"), tolerance)
    else:
        assert metrics(out)[-1]["val_acc"] > 0.9


def test_a_stream_stopped_mid_epoch_continues_exactly_on_two_processes_and_on_one(
    streamed, tmp_path
):
    """SIGTERM on rank 0 in epoch 2's step 7: every rank stops after step 8 (the agreement runs a step behind) and
    saves; the same command continues on 2 processes, and a copy of the checkpoint on 1, each reading the stream
    from the global batch where it stopped."""
    base, results = streamed
    stopped = results["stopped"]
    assert (
        stopped.returncode != 0
        and "stopped by SIGTERM after step 8/25 of epoch 2" in stopped.stderr
    ), stopped.stderr
    for name in ("on-two", "on-one"):
        shutil.copytree(base / "stopped", tmp_path / name)
    again, on_one = run_parallel(
        [
            (command("distributed.py", tmp_path, "on-two", 2, "--workers", "2"), UNEVEN),
            (command("distributed.py", tmp_path, "on-one", 1), {}),
        ],
        timeout=300,
        cwd=tmp_path,
    )
    assert "1 of 3 epochs done and 8 steps of the next" in again.stdout
    assert_trained_as_the_reference(tmp_path / "on-two", succeeded(streamed, "two"), 1e-6)
    assert_trained_as_the_reference(tmp_path / "on-one", succeeded(streamed, "two"), 1e-5)


def test_what_a_stream_cannot_do_ends_every_rank_with_one_line(tmp_path):
    """Started at once: no --steps-per-epoch for a stream without __len__ (2 processes); fewer samples than one
    global batch, with and without __len__; samples collate cannot stack."""
    ragged = YOUR_STREAM.replace(
        "yield self.inputs[i] + noise, int(self.labels[i])",
        "yield self.inputs[i][:, :1 + i % 8], int(self.labels[i])",
    )
    assert ragged != YOUR_STREAM
    copies = {
        name: copy_with_your_functions("distributed.py", tmp_path / name, code)
        for name, code in (("yours", YOUR_STREAM), ("ragged", ragged))
    }
    no_cut = [arg for arg in STREAM if arg not in ("--steps-per-epoch", "25")]
    runs = {  # name: (copy, processes, flags, environment, the line)
        "no cut": (
            "yours",
            2,
            no_cut,
            {},
            "error: the training set is a stream without __len__: give "
            "--steps-per-epoch N, the optimizer steps of an epoch",
        ),
        "short, sized": (
            "yours",
            1,
            STREAM,
            {"TRAIN_SIZE": "20", "LENGTH": "1"},
            "error: the training data gave no full batch this epoch: lower --batch-size or use more data",
        ),
        "short": (
            "yours",
            1,
            STREAM,
            {"TRAIN_SIZE": "20"},
            "error: the training data gave no full batch this epoch",
        ),
        "ragged": (
            "ragged",
            1,
            STREAM,
            {},
            "error: collate cannot batch its samples: stack expects each tensor to be equal size",
        ),
    }
    started = {
        name: start(
            launch(copies[copy], processes, *flags, "--output-dir", tmp_path / name),
            env=env,
            cwd=tmp_path,
        )
        for name, (copy, processes, flags, env, _) in runs.items()
    }
    for name, (_, processes, _, _, line) in runs.items():
        ends_every_rank_with(finish(*started[name], timeout=90), line, processes)


def split(
    stream, batch_per_rank: int, world_size: int, workers: int, skip: int = 0
) -> list[list[int]]:
    """What each rank's loader gives, in order: the samples of each of its batches."""
    given = []
    for rank in range(world_size):
        sampler = streams.StreamSampler(stream, batch_per_rank * world_size, rank, world_size)
        loader = DataLoader(
            streams.Samples(), None, sampler=sampler, num_workers=workers, collate_fn=list
        )
        given.append(list(utils.epoch_loader(loader, 0, skip)))
    return given


@pytest.mark.filterwarnings(
    "ignore:This DataLoader will create"
)  # 3 workers on 2 cores: for the split only
def test_the_split_gives_every_sample_of_a_full_global_batch_once_in_order_with_any_workers():
    numbers = type(
        "Numbers", (torch.utils.data.IterableDataset,), {"__iter__": lambda self: iter(range(100))}
    )()
    for workers in (0, 3):
        ranks = split(numbers, 8, 2, workers)
        # 6 full global batches of 16 (4 samples dropped): rank r gets samples 8r..8r+7 of each, in order
        assert ranks == [
            [list(range(16 * b + 8 * r, 16 * b + 8 * r + 8)) for b in range(6)] for r in range(2)
        ]
        assert split(numbers, 8, 2, workers, skip=4) == [
            batches[4:] for batches in ranks
        ]  # a continued epoch
    validation = streams.StreamSampler(
        numbers, 16, 1, 2, train=False
    )  # rank 1 of 2: the last 4 samples are rank 0's
    assert [s for part in validation for s in part] == [
        s for b in range(6) for s in range(16 * b + 8, 16 * b + 16)
    ]


class Files(torch.utils.data.IterableDataset):
    """A stream of files of these many samples (file, i), with n_shards and shard() as a Hugging Face stream has."""

    def __init__(self, sizes: dict[int, int]):
        self.sizes = sizes

    n_shards = property(lambda self: len(self.sizes))

    def shard(self, num_shards: int, index: int) -> "Files":
        return Files(dict(list(self.sizes.items())[index::num_shards]))

    def __iter__(self):
        return ((f, i) for f, size in self.sizes.items() for i in range(size))


def test_shards_of_different_sizes_give_every_sample_once_in_an_order_of_the_stream_alone():
    """Files of 40, 35, 25 and 20 samples, batch 8: 4 readers of one file, 2 samples of each a batch, until the
    20-sample one ends (10 batches); then what the others have left, 2 of each in turns (the 25-sample file's last 1
    alone), cut into batches of 8: all 120 samples, 15 batches. As micro-batches (accumulation) the same."""
    files = Files({0: 40, 1: 35, 2: 25, 3: 20})
    batches = list(streams.StreamSampler(files, 8, 0, 1))
    assert batches[:10] == [
        [(f, i) for f in range(4) for i in (2 * b, 2 * b + 1)] for b in range(10)
    ]
    turns = [[(f, i) for f in range(3) if i < files.sizes[f]] for i in range(20, 40)]
    rest = [
        sample
        for turn in zip(turns[0::2], turns[1::2])
        for f in range(3)
        for sample in [s for part in turn for s in part if s[0] == f]
    ]
    assert [s for batch in batches[10:] for s in batch] == rest and len(batches) == 15
    assert sorted(s for batch in batches for s in batch) == sorted(iter(files))
    micro = list(streams.StreamSampler(files, 4, 0, 1, micro_batches=2))
    assert [a + b for a, b in zip(micro[0::2], micro[1::2])] == batches and len(micro) == 30


def test_epochs_of_a_stream_come_from_its_length_or_steps_per_epoch():
    yours = users_code(YOUR_STREAM)
    args = argparse.Namespace(steps_per_epoch=None, batch_size=32)
    sized = DataLoader(
        streams.Samples(),
        None,
        sampler=streams.StreamSampler(yours["SizedBlobStream"](640, 1), 32, 0, 2),
    )
    assert utils.steps_per_epoch(sized, args) == 20 and utils.steps_per_epoch(sized, args, 4) == 5
    args.steps_per_epoch = 15
    assert utils.steps_per_epoch(sized, args) == 15  # cut
    unsized = DataLoader(
        streams.Samples(),
        None,
        sampler=streams.StreamSampler(yours["BlobStream"](640, 1), 32, 0, 2),
    )
    assert utils.steps_per_epoch(unsized, args) == 15


def write_json_lines(
    directory, files: int, lines: int | list[int], seed: int, tar: bool = False
) -> None:
    """{"id", "text": token ids, "label": 0..3} records, half of whose tokens are 20 of the label's own, half of any
    of 999: files of `lines` records each (or each count of a list), JSON lines or webdataset tar shards (ID.json)."""
    generator = torch.Generator().manual_seed(seed)
    directory.mkdir(parents=True)
    for f, count in enumerate([lines] * files if isinstance(lines, int) else lines):
        records = []
        for i in range(count):
            label = int(torch.randint(4, (), generator=generator))
            length = int(torch.randint(5, 21, (), generator=generator))
            own = 1 + 250 * label + torch.randint(0, 20, (length,), generator=generator)
            other = torch.randint(1, 1000, (length,), generator=generator)
            text = torch.where(torch.rand(length, generator=generator) < 0.5, own, other)
            records.append(
                json.dumps({"id": f"{seed}-{f}-{i}", "text": text.tolist(), "label": label})
            )
        if not tar:
            (directory / f"part-{f}.jsonl").write_text("".join(f"{record}\n" for record in records))
            continue
        with tarfile.open(directory / f"part-{f}.tar", "w") as shard:
            for record in records:
                member = tarfile.TarInfo(f"{json.loads(record)['id']}.json")
                member.size = len(record.encode())
                shard.addfile(member, io.BytesIO(record.encode()))


def docs_example(after: str) -> str:
    """The code of the first python block after the text `after` in docs/your-project.md's part on streams."""
    page = (ROOT / "docs" / "your-project.md").read_text()
    part = page[page.index("## Data that streams") :]
    return re.search(r"```python\n(.*?)```", part[part.index(after) :], re.S).group(1)


def test_the_json_lines_example_in_the_docs_trains_as_shown(tmp_path):
    """docs/your-project.md's stream of JSON lines, pasted into distributed.py as a user would, run by the command
    the page shows: it learns, every validation line is counted once, and epochs are cut at --steps-per-epoch."""
    page = (ROOT / "docs" / "your-project.md").read_text()
    part = page[page.index("## Data that streams") :]
    code = docs_example("A complete example")
    command = re.search(r"`(torchrun [^`]*distributed.py[^`]*)`", part).group(1).split()
    write_json_lines(
        tmp_path / "data" / "train", files=3, lines=400, seed=1
    )  # 37 global batches of 32 a pass
    write_json_lines(tmp_path / "data" / "val", files=2, lines=101, seed=2)
    copy = copy_with_your_functions("distributed.py", tmp_path / "copy", code)
    nproc = int(command[2].split("=")[1])
    result = finish(
        *start(
            launch(copy, nproc, *command[4:], "--timeout", "60", "--output-dir", tmp_path / "out"),
            cwd=tmp_path,
        ),
        timeout=150,
    )
    assert result.returncode == 0, result.stderr
    records = steps(tmp_path / "out")
    assert {r["step"] for r in records if "train_loss" in r} <= set(range(1, 31)) and records[-1][
        "step"
    ] == 30
    assert {r["val_images"] for r in records if "val_images" in r} == {202}
    assert metrics(tmp_path / "out")[-1]["val_acc"] > 0.9
