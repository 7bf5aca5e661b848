"""Machines that come and go: a node lost or gained under torchrun's elastic launch, with the rendezvous store held
by no training node (docs/launching.md), continues to what a fixed-size run trains; and any world size trains, also
one that does not divide the global batch."""

from __future__ import annotations

import concurrent.futures
import signal
import os
import subprocess
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import utils
from extras.elastic import GlobalBatchShares
from extras import streams
from processes import (
    AGENT_ENV,
    TINY,
    assert_same_records,
    elastic_agent,
    ends_every_rank_with,
    finish,
    free_port,
    listening,
    kill_everything_started_by,
    max_weight_difference,
    metrics,
    python,
    rendezvous_store,
    run_parallel,
    start,
    steps,
    torchrun,
    trained_steps,
    training_processes,
    wait_for,
    warm_starts,
)

# 150 steps an epoch of the tiny job, no augmentation: the same model on any number of processes
ELASTIC = [*TINY, "--no-augment", "--fake-size", "6000", "--epochs", "2", "--print-freq", "8"]


def agent(port: int, out: Path, *flags) -> list:
    """A node's torchrun agent, one process, elastic between 1 and 2 nodes, meeting at the store."""
    return elastic_agent(
        port, "elastic-test", "1:2", 3, "distributed.py", *ELASTIC, *flags, "--output-dir", out
    )


def saved_step(out: Path) -> int:
    """The step of epoch 1 that out's checkpoint was saved after (0 without one, or after epoch 1)."""
    path = out / "checkpoint.pt"
    if not path.exists():
        return 0
    state = torch.load(path, weights_only=True)
    if state["epoch"]:
        return 0
    return state["step"]


def rank_of(marker: str) -> int | None:
    """The rank of the training process an agent (its kill marker) runs now."""
    for pid in training_processes(marker, "distributed.py"):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in environ:
            if entry.startswith(b"RANK="):
                return int(entry[5:])
    return None


def store_connections(port: int) -> int:
    """How many TCP connections the store on port holds now (each agent's client is one)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:  # ESTABLISHED
                count += 1
    return count


def join_mid_epoch(port: int, out: Path, lone: str) -> tuple:
    """After the lone agent's first steps, a second agent joins it. The lone training process is paused while the
    second one starts, so that a loaded machine cannot let it train the whole job alone first."""
    wait_for(lambda: trained_steps(out) >= 8, 240, "the first agent's steps alone")
    worker = training_processes(lone, "distributed.py")[0]
    os.kill(worker, signal.SIGSTOP)
    try:
        before = store_connections(port)
        second = start(agent(port, out), AGENT_ENV)
        # well within --timeout 60, the watchdog's bound on one step
        wait_for(lambda: store_connections(port) > before, 40, "the second agent at the store")
    finally:
        os.kill(worker, signal.SIGCONT)
    return second


@pytest.fixture(scope="module")
def elastic(tmp_path_factory) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """At once: a straight 2-process run; "lost", two agents, the one running rank 0 killed (every process of it:
    the node is gone) mid-epoch after a checkpoint written by --save-minutes; "joined", one agent training alone,
    a second started mid-epoch. Each pair of agents meets at a store of its own."""
    base = tmp_path_factory.mktemp("elastic")
    stores = {name: free_port() for name in ("lost", "joined")}
    for port in stores.values():
        start(rendezvous_store(port))
    wait_for(lambda: all(listening(p) for p in stores.values()), 60, "the stores")
    with warm_starts():  # the reference: its launch is not what the tests check
        straight = start(torchrun(2, "distributed.py", *ELASTIC, "--output-dir", base / "straight"))
    lost = base / "lost"
    pair = [start(agent(stores["lost"], lost, "--save-minutes", "0.02"), AGENT_ENV) for _ in "ab"]
    joined = base / "joined"
    first = start(agent(stores["joined"], joined), AGENT_ENV)
    results = {}
    with concurrent.futures.ThreadPoolExecutor(1) as beside:
        second = beside.submit(join_mid_epoch, stores["joined"], joined, first[1])
        # a checkpoint saved by the clock after two records of world size 2 (a slow machine saves after fewer steps
        # than those, and continuing drops the records after the checkpoint), and steps after it, in epoch 1
        wait_for(lambda: saved_step(lost) >= 16 and trained_steps(lost) >= 24, 240, "a save")
        assert not (lost / "metrics.jsonl").exists(), "epoch 1 ended before the kill: lengthen it"
        victim = next(marker for _, marker in pair if rank_of(marker) == 0)
        kill_everything_started_by(victim)
        killed_at = trained_steps(lost)
        second = second.result()
    survivor = next((proc, marker) for proc, marker in pair if marker != victim)
    results["lost"] = finish(*survivor, timeout=300)
    results["joined"] = finish(*first, timeout=300)
    results["second"] = finish(*second, timeout=300)
    results["straight"] = finish(*straight, timeout=300)
    for name, result in results.items():
        assert result.returncode == 0, (name, result.stdout[-3000:], result.stderr[-3000:])
    assert killed_at < 150
    return base, results


def assert_continued_as_the_straight_run(out: Path, straight: Path, world_sizes: list[int]) -> None:
    """The straight run's weights and records, each step's record once, and the world sizes the records show."""
    assert max_weight_difference(out, straight) <= 1e-5
    assert_same_records(steps(out), steps(straight), tolerance=1e-5)
    shown = [r["world_size"] for r in steps(out)]
    assert [size for i, size in enumerate(shown) if i == 0 or shown[i - 1] != size] == world_sizes
    assert [m["epoch"] for m in metrics(out)] == [1, 2]


@pytest.mark.real_launch  # the launch itself: torchrun's elastic agents
def test_the_node_holding_rank_0_lost_mid_epoch_the_other_continues_to_the_straight_run(elastic):
    base, results = elastic
    assert_continued_as_the_straight_run(base / "lost", base / "straight", [2, 1])
    assert "continuing from" in results["lost"].stdout
    assert "on 1 process, written on 2:" in results["lost"].stdout


@pytest.mark.real_launch  # the launch itself: torchrun's elastic agents
def test_a_node_that_joins_mid_epoch_trains_on_to_the_straight_run(elastic):
    base, results = elastic
    assert_continued_as_the_straight_run(base / "joined", base / "straight", [1, 2])
    said = "".join(r.stdout + r.stderr for r in (results["joined"], results["second"]))
    assert "stopped by SIGTERM after step" in said  # the lone agent's process saved where it was
    assert "on 2 processes, written on 1:" in said


# the tiny job with a global batch of 64: 21 or 22 samples a rank on 3 processes
THIRDS = [*TINY, "--no-augment", "--batch-size", "64", "--epochs", "2"]
AUGMENTED = [*TINY, "--batch-size", "64", "--epochs", "2"]


@pytest.fixture(scope="module")
def thirds(tmp_path_factory) -> tuple[Path, list[subprocess.CompletedProcess]]:
    """1 process, and 3 processes of distributed.py, distributed_grad_accum.py (2 micro-batches of 32: 10 or 11 a
    rank) and distributed_fsdp.py; and 1 and 3 processes of distributed.py with augmentation; at once."""
    base = tmp_path_factory.mktemp("thirds")
    runs = [
        python("distributed.py", *THIRDS, "--output-dir", base / "one"),
        torchrun(3, "distributed.py", *THIRDS, "--output-dir", base / "ddp"),
        torchrun(
            3,
            "distributed_grad_accum.py",
            *THIRDS,
            "--accum-steps",
            "2",
            "--output-dir",
            base / "accum",
        ),
        torchrun(3, "distributed_fsdp.py", *THIRDS, "--output-dir", base / "fsdp"),
        # with the default augmentation: each image's crop and flip drawn by its place in the global batch
        python("distributed.py", *AUGMENTED, "--output-dir", base / "one-augmented"),
        torchrun(3, "distributed.py", *AUGMENTED, "--output-dir", base / "ddp-augmented"),
    ]
    return base, run_parallel([(cmd, {}) for cmd in runs], timeout=300)


@pytest.mark.parametrize(
    "name, first_line",
    [("ddp", "batch 64 = 3 x 21-22,"), ("accum", "batch 64 = 2 micro-batches of 3 x 10-11,")],
)
def test_three_processes_train_what_one_does_with_a_batch_they_do_not_divide(
    thirds, name, first_line
):
    base, results = thirds
    assert first_line in results[["ddp", "accum"].index(name) + 1].stdout
    assert max_weight_difference(base / name, base / "one") <= 1e-5
    assert_same_records(steps(base / name), steps(base / "one"), tolerance=1e-5)
    # every validation image counted once
    assert {r["val_images"] for r in steps(base / name) if "val_images" in r} == {207}


def test_three_processes_with_the_default_augmentation_train_what_one_does(thirds):
    base, _ = thirds
    assert max_weight_difference(base / "ddp-augmented", base / "one-augmented") <= 1e-5
    assert metrics(base / "one-augmented")[-1]["val_acc"] > 0.9


def test_fsdp_trains_on_three_processes(thirds):
    base, _ = thirds
    assert metrics(base / "fsdp")[-1]["val_acc"] > 0.9
    assert max_weight_difference(base / "fsdp", base / "one") <= 1e-5


def test_shares_of_a_global_batch_are_distributed_samplers_where_the_batch_divides_and_within_one_sample_else():
    data = list(range(1035))

    def loaded(batch: int, rank: int, world_size: int) -> list[list[int]]:
        sampler = GlobalBatchShares(data, batch, rank, world_size, seed=3)
        size = utils.share(batch, rank, world_size)
        return [b.tolist() for b in DataLoader(data, size, sampler=sampler, drop_last=True)]

    for world_size in (1, 2, 4):
        for rank in range(world_size):
            sampler = DistributedSampler(data, world_size, rank, seed=3, drop_last=True)
            expected = DataLoader(data, 64 // world_size, sampler=sampler, drop_last=True)
            assert loaded(64, rank, world_size) == [b.tolist() for b in expected]
    one = loaded(64, 0, 1)
    three = [loaded(64, rank, 3) for rank in range(3)]
    assert [len(shares[0]) for shares in three] == [22, 21, 21]
    for step, batch in enumerate(one):
        assert sorted(sum((shares[step] for shares in three), [])) == sorted(batch)
    assert all(len(shares) == len(one) == 1035 // 64 for shares in three)


def test_a_stream_splits_a_global_batch_the_ranks_do_not_divide_into_runs_within_one_sample():
    numbers = type(
        "Numbers", (torch.utils.data.IterableDataset,), {"__iter__": lambda self: iter(range(100))}
    )()
    given = [list(streams.StreamSampler(numbers, 16, rank, 3)) for rank in range(3)]
    assert [[len(b) for b in batches_of_rank] for batches_of_rank in given] == [
        [6] * 6,
        [5] * 6,
        [5] * 6,
    ]
    # the 6 full global batches, each in order, once
    assert [s for b in range(6) for rank in range(3) for s in given[rank][b]] == list(range(96))
    validation = [
        list(streams.StreamSampler(numbers, 16, rank, 3, train=False)) for rank in range(3)
    ]
    assert sorted(s for part in validation for b in part for s in b) == list(range(100))


def test_a_batch_smaller_than_the_world_or_than_its_micro_batches_ends_in_one_line(tmp_path):
    small, uneven, minutes = run_parallel(
        [
            (
                torchrun(2, "distributed.py", *TINY, "--batch-size", "1", "--output-dir", tmp_path),
                {},
            ),
            (python("distributed_grad_accum.py", *TINY, "--accum-steps", "3"), {}),
            (python("distributed.py", *TINY, "--save-minutes", "0"), {}),
        ],
        timeout=90,
        check=False,
    )
    ends_every_rank_with(
        small, "error: --batch-size 1 is smaller than 2 processes: give each at least one sample"
    )
    for result, line in (
        (
            uneven,
            "error: --batch-size 32 does not split into 3 micro-batches: use a multiple of --accum-steps (at least 1)"
            " (see distributed_grad_accum.py --help)",
        ),
        (minutes, "error: --timeout, --clip-grad, --save-minutes and --peak-tflops must be > 0"),
    ):
        assert result.returncode != 0 and "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines()[-1] == line
