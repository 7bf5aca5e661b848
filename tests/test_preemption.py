"""Nothing lost: a preempted run (SIGTERM, SIGUSR1) saves where every rank stopped and the same
command continues exactly; a full disk or an unusable output directory ends every rank with one
line and loses nothing; a model that cannot take the images says what to change before training."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from processes import (
    EVAL_EVERY,
    LONG,
    TINY,
    assert_same_records,
    ends_every_rank_with,
    finish,
    free_port,
    max_weight_difference,
    metrics,
    python,
    run,
    run_parallel,
    start,
    steps,
    torchrun,
    trained_steps,
    wait_for,
    warm_starts,
)
from test_records import assert_curves_equal_the_records
from projects import copy_with_your_functions
from extras import checkpoints


def by_hand(out: Path, port: int) -> list[tuple[list, dict]]:
    """Two ranks started by hand, as srun starts Slurm tasks: each gets its own signal."""
    return [
        (
            python(
                "distributed.py", *LONG, "--ip", "127.0.0.1", "--port", port, "--output-dir", out
            ),
            {"RANK": str(r), "WORLD_SIZE": "2"},
        )
        for r in (0, 1)
    ]


def saved_position(out: Path) -> tuple[int, int]:
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    return state["epoch"], state["step"]


@pytest.mark.alone  # its bound on seconds
def test_sigterm_mid_epoch_saves_and_the_same_command_continues_exactly(tmp_path, long_straight):
    out = tmp_path / "preempted"
    ranks = [start(cmd, env) for cmd, env in by_hand(out, free_port())]
    wait_for(lambda: (out / "checkpoint.pt").exists(), 120, "the first checkpoint")
    time.sleep(0.5)  # into epoch 2
    assert all(proc.poll() is None for proc, _ in ranks), (
        "finished before the signal: make the epochs longer"
    )
    ranks[1][0].send_signal(signal.SIGTERM)  # one rank only: the other must stop at the same step
    signalled = time.monotonic()
    results = [finish(proc, marker, timeout=60) for proc, marker in ranks]
    seconds = time.monotonic() - signalled
    epoch, step = saved_position(out)
    assert epoch == 1 and 0 < step < 250, (epoch, step)
    for result in results:
        assert result.returncode == 128 + signal.SIGTERM, result.stderr
        assert result.stderr.strip().splitlines()[-1] == (
            f"stopped by SIGTERM after step {step}/250 of epoch 2, saved: the same command continues from there"
        )
        assert "Traceback" not in result.stderr
    print(
        f"SIGTERM to rank 1: both ranks stopped after step {step}/250 of epoch 2, exited {seconds:.1f} s later"
    )
    assert seconds < 25  # Slurm's grace before SIGKILL is 30 s

    second = run_parallel(by_hand(out, free_port()))
    assert f"1 of 2 epochs done and {step} steps of the next" in second[0].stdout
    assert [m["epoch"] for m in metrics(out)] == [1, 2]
    difference = max_weight_difference(out, long_straight)
    print(f"continued run vs straight run: max weight difference {difference:.1e}")
    assert difference <= 1e-6
    assert_same_records(
        steps(out), steps(long_straight), tolerance=1e-6
    )  # none twice, none missing
    # the run's picture holds the whole run, each record once, as the straight run's does
    assert_curves_equal_the_records(out)
    assert len(steps(out)) == len(steps(long_straight))


@pytest.mark.real_launch  # the launch itself
def test_sigterm_to_torchrun_reaches_the_data_loader_workers_and_still_saves_where_every_rank_stopped(
    tmp_path, long_straight
):
    """SIGTERM to torchrun (as Kubernetes and docker stop send it; Slurm signals every process of a step): torchrun
    passes it to each rank's whole process group, DataLoader workers too, which leave it to the rank that saves."""
    out = tmp_path / "preempted"
    command = torchrun(2, "distributed.py", *LONG, "--workers", "2", "--output-dir", out)
    proc, marker = start(command)
    wait_for(lambda: (out / "checkpoint.pt").exists(), 120, "the first checkpoint")
    time.sleep(0.5)  # into epoch 2
    assert proc.poll() is None, "finished before the signal: make the epochs longer"
    proc.send_signal(signal.SIGTERM)
    result = finish(proc, marker, timeout=60)
    epoch, step = saved_position(out)
    assert epoch == 1 and 0 < step < 250, (epoch, step)
    line = f"stopped by SIGTERM after step {step}/250 of epoch 2, saved: the same command continues from there"
    assert result.stderr.count(line) == 2, (
        result.stderr
    )  # each rank's (torchrun's own traceback follows)
    assert "DataLoader worker" not in result.stderr, result.stderr

    with warm_starts():  # the continuation: its launch is not what this test checks
        run(command)  # with workers, as the straight run without: the same batches
    assert max_weight_difference(out, long_straight) <= 1e-6
    assert_same_records(steps(out), steps(long_straight), tolerance=1e-6)


@pytest.mark.parametrize(
    "script, extra",
    [
        ("distributed_mp.py", ["--nproc", "2"]),  # the parent passes the signal on to its children
        # one process, no communication: 4000 images took 0.3 s an epoch (bfloat16 on CI's CPU
        # too: 11.7k images/s, and the run ended before the signal)
        ("distributed_amp.py", ["--amp-dtype", "bfloat16", "--fake-size", "16000"]),
        ("distributed_grad_accum.py", ["--accum-steps", "2"]),
        ("dataparallel.py", ["--fake-size", "16000"]),
    ],
)
def test_sigusr1_stops_every_script_at_a_saved_step(script, extra, tmp_path):
    out = tmp_path / "out"
    proc, marker = start(python(script, *LONG, "--fake-size", "4000", *extra, "--output-dir", out))
    wait_for(lambda: (out / "checkpoint.pt").exists(), 120, "the first checkpoint")
    time.sleep(0.3)
    assert proc.poll() is None, "finished before the signal: make the epochs longer"
    proc.send_signal(
        signal.SIGUSR1
    )  # what Slurm's --signal=USR1@SECONDS sends before the time limit
    result = finish(proc, marker, timeout=60)
    assert result.returncode == 128 + signal.SIGUSR1, result.stderr
    epoch, step = saved_position(out)
    assert epoch == 1 and step > 0
    assert (
        result.stderr.strip().splitlines()[-1].startswith(f"stopped by SIGUSR1 after step {step}/")
    )
    assert "Traceback" not in result.stderr


def test_save_every_bounds_what_a_sigkill_loses(tmp_path):
    proc, marker = start(
        python(
            "distributed.py",
            *LONG,
            "--fake-size",
            "4000",
            "--save-every",
            "20",
            "--output-dir",
            tmp_path,
        )
    )
    wait_for(lambda: (tmp_path / "checkpoint.pt").exists(), 120, "the first checkpoint")
    proc.kill()  # no chance to save: what --save-every wrote is what is left
    finish(proc, marker, timeout=60)
    epoch, step = saved_position(tmp_path)
    assert epoch == 0 and step % 20 == 0 and step > 0  # at most 19 steps lost
    second = run(python("distributed.py", *LONG, "--fake-size", "4000", "--output-dir", tmp_path))
    assert f"0 of 2 epochs done and {step} steps of the next" in second.stdout
    assert [m["epoch"] for m in metrics(tmp_path)] == [1, 2]


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB file system of its own (tmpfs), so that it can be filled up."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs")
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", mount_point],
            capture_output=True,
            timeout=30,
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", mount_point], capture_output=True, timeout=30)


def fill(disk: Path, leave: int) -> Path:
    """A file that takes all the free space of disk but `leave` bytes."""
    stats = os.statvfs(disk)
    filler = disk / "filler"
    filler.write_bytes(b"\0" * max(0, stats.f_bavail * stats.f_frsize - leave))
    return filler


def test_a_full_disk_ends_every_rank_with_one_line_and_loses_nothing(small_disk, reference):
    """The disk fills while rank 0 appends a step's record, then while it writes the checkpoint: each time every
    rank ends with one line naming the file, no part line or temporary file is left, and once there is space the
    same command continues to the reference's weights with every step's record once."""
    args = [
        *TINY,
        "--no-augment",
        "--print-freq",
        "1",
    ]  # the reference job, a record of about 230 bytes a step
    out = small_disk / "run"
    run(torchrun(2, "distributed.py", *args, "--stop-after", "1", "--output-dir", out))
    # the records fit in 64 KB, the checkpoint's 427 KB do not (epoch 2's metrics line is written before it)
    for unwritten, leave, epochs in (("steps.jsonl", 0, [1]), ("checkpoint.pt", 64 * 1024, [1, 2])):
        # The tmpfs gives a file whole pages: what steps.jsonl's last page has left (its length varies with the speeds
        # recorded) holds epoch 2's first records, and one page more where that is under 4 of them.
        page = os.statvfs(small_disk).f_frsize
        room = -(out / unwritten).stat().st_size % page
        if unwritten == "steps.jsonl" and room < 1000:
            leave += page
        filler = fill(small_disk, leave=leave)
        failed = run(torchrun(2, "distributed.py", *args, "--output-dir", out), check=False)
        ends_every_rank_with(
            failed,
            f"error: cannot write {out / unwritten}: No space left on device: free space "
            f"or use another --output-dir",
        )
        assert "enforce fail" not in failed.stderr
        assert sorted(p.name for p in out.iterdir()) == [
            "checkpoint.pt",
            "curves.svg",
            "metrics.jsonl",
            "model_ema.pt",
            "steps.jsonl",
        ]
        assert (
            saved_position(out) == (1, 0) and [m["epoch"] for m in metrics(out)] == epochs
        )  # the last, whole
        assert (
            steps(out)[-1]["global_step"] > 32
        )  # every line whole: records of epoch 2, up to the full disk
        filler.unlink()
    run(torchrun(2, "distributed.py", *args, "--output-dir", out))
    assert [m["epoch"] for m in metrics(out)] == [1, 2, 3]
    assert [r["global_step"] for r in steps(out) if "train_loss" in r] == list(range(1, 97))
    assert max_weight_difference(out, reference["two"]) <= 1e-6


def test_an_output_path_under_a_file_fails_at_once_on_every_rank(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    out = tmp_path / "a-file" / "out"
    result = run(torchrun(2, "distributed.py", *TINY, "--output-dir", out), timeout=60, check=False)
    line = f"error: cannot write {out}: Not a directory: free space or use another --output-dir"
    ends_every_rank_with(result, line)
    assert "world size" not in result.stdout  # before any data or model was built


@pytest.mark.parametrize("arch, size, works", [("inception_v3", 32, 80), ("vit_b_16", 40, 48)])
def test_a_model_that_cannot_take_the_image_size_says_which_size_works(arch, size, works, tmp_path):
    result = run(
        python(
            "distributed.py",
            *TINY,
            "--arch",
            arch,
            "--image-size",
            str(size),
            "--fake-size",
            "64",
            "--output-dir",
            tmp_path,
        ),
        timeout=120,
        check=False,
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: --arch {arch} cannot take {size}x{size} images (")
    assert last.endswith(f"use --image-size {works} or another --arch"), last
    assert not (tmp_path / "checkpoint.pt").exists()


def test_models_with_auxiliary_outputs_train(tmp_path):
    run(
        python(
            "distributed.py",
            *TINY,
            "--arch",
            "googlenet",
            "--image-size",
            "32",
            "--fake-size",
            "64",
            "--batch-size",
            "16",
            "--epochs",
            "1",
            "--output-dir",
            tmp_path,
        ),
        timeout=120,
    )
    assert metrics(tmp_path)[-1]["val_images"] == 12


# A slow disk: each checkpoint's write takes WRITE_SECONDS longer, in the thread that writes it, its temporary file on
# disk meanwhile.
SLOW_WRITES = """
import threading as _threading
import time as _time

_real_save = torch.save


def _slow_save(obj, f, *args, **kwargs):
    _real_save(obj, f, *args, **kwargs)
    if _threading.current_thread() is not _threading.main_thread():
        _time.sleep(float(os.environ.get("WRITE_SECONDS", "0")))


torch.save = _slow_save


"""


def test_a_run_killed_while_a_checkpoint_is_written_in_the_background_continues_exactly(
    tmp_path, reference
):
    """A checkpoint every 4 steps on a disk that takes 1.5 s a write: rank 0 trains on while the second is written
    (steps recorded past the save's step, its temporary file on disk), and every process is SIGKILLed then. The same
    command continues from a whole checkpoint to the straight run's weights (1e-6), each step's record once."""
    out = tmp_path / "out"
    writing = lambda: list(out.glob(".checkpoint.pt.tmp*"))  # noqa: E731
    assert_killed_while_writing_continues(
        "distributed.py", SLOW_WRITES, writing, out, reference["two"]
    )


def assert_killed_while_writing_continues(
    script: str, slow: str, writing, out: Path, straight: Path
) -> None:
    """script, with slow (code that makes its writing thread's writes WRITE_SECONDS=1.5 s longer), on 2
    processes, a checkpoint every 4 steps: every process SIGKILLed once training has gone 2 steps past a save
    whose write is still in flight (writing() true), after a whole checkpoint; then the same command continues
    from a whole checkpoint to straight's weights (1e-6), each step's record once."""
    script = copy_with_your_functions(script, out.with_name("copy"), None)
    text = script.read_text()
    script.write_text(
        text.replace('if __name__ == "__main__":', slow + 'if __name__ == "__main__":')
    )
    args = [*TINY, "--no-augment", *EVAL_EVERY, "--save-every", "4", "--print-freq", "1"]
    args += ["--output-dir", out]
    proc, marker = start(torchrun(2, script, *args), {"WRITE_SECONDS": "1.5"})
    # a whole checkpoint on disk, and the next one being written
    whole = lambda: any((out / name).exists() for name in ("checkpoint.pt", "checkpoint"))  # noqa: E731
    wait_for(lambda: whole() and writing(), 120, "a second checkpoint being written")
    begun = trained_steps(out)
    # training goes on while the same write is in flight
    wait_for(lambda: trained_steps(out) >= begun + 2, 60, "steps past the save")
    assert writing(), "the write ended before the steps: no overlap seen"
    proc.kill()
    finish(proc, marker, timeout=60)
    continued = run(torchrun(2, script, *args))
    # from a whole checkpoint: the first, or (a loaded machine, the kill after that write ended) a later one
    done = re.search(r"0 of 3 epochs done and (\d+) steps of the next", continued.stdout)
    assert done and int(done[1]) % 4 == 0 and int(done[1]) > 0, continued.stdout
    assert max_weight_difference(out, straight) <= 1e-6
    assert [r["global_step"] for r in steps(out) if "train_loss" in r] == list(range(1, 97))


def memory_cgroup(
    root: Path, limit: str, usage: str, bound: int, used: int, dropped: int = 0
) -> Path:
    """A memory cgroup's files at root (version 2's names, or version 1's under memory/), limited to bound bytes,
    using used of them, dropped of which inactive page cache."""
    folder = root / ("memory" if limit.endswith("_in_bytes") else "")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / limit).write_text(f"{bound}\n")
    (folder / usage).write_text(f"{used}\n")
    (folder / "memory.stat").write_text(
        f"anon {used - dropped}\ninactive_file {dropped}\ntotal_inactive_file {dropped}\n"
    )
    return root


@pytest.mark.parametrize(
    "limit, usage",
    [("memory.max", "memory.current"), ("memory.limit_in_bytes", "memory.usage_in_bytes")],
)
def test_a_memory_cgroups_limit_bounds_the_memory_available(tmp_path, monkeypatch, limit, usage):
    """A container's or a Slurm job's memory limit (cgroup version 2 or 1), not the host's MemAvailable, is what a
    background save's copy and FSDP's start-up line measure against: the limit less what is used, the inactive
    page cache counted as free; no limit, the host's alone."""
    monkeypatch.setattr(
        checkpoints, "CGROUP", memory_cgroup(tmp_path, limit, usage, 2**30, 2**29, 2**28)
    )
    assert checkpoints.cgroup_memory_left() == 2**30 - 2**29 + 2**28
    assert checkpoints.host_memory_available() <= 2**30 - 2**29 + 2**28
    (tmp_path / "memory" if limit.endswith("_in_bytes") else tmp_path).joinpath(limit).write_text(
        "max\n" if limit == "memory.max" else f"{2**63 - 4096}\n"
    )
    assert checkpoints.cgroup_memory_left() == float("inf")


def test_a_background_save_writes_the_state_of_its_moment_a_tied_tensor_once_and_says_a_failed_write(
    tmp_path, monkeypatch
):
    """Saves: the state as it was when saved, though training changes it before the write; a tensor under two
    keys (a tied head) saved as one; the same file saved again into its kept copies; a failed write told by
    failed() and raised by wait(), naming the file; where host memory has no room for a copy, the file written
    before save() returns, no copy kept."""
    weights = torch.randn(5, 3)
    then = weights.clone()
    state = {"head": weights, "embedding": weights, "step": torch.tensor(3), "name": "x"}
    with checkpoints.Saves() as saves:
        saves.save(state, tmp_path / "a.pt")
        weights.add_(1)  # the next step
        saves.wait()
        written = torch.load(tmp_path / "a.pt", weights_only=True)
        assert torch.equal(written["head"], then) and written["name"] == "x"
        assert written["head"].data_ptr() == written["embedding"].data_ptr()
        saves.save(state, tmp_path / "a.pt")
        saves.wait()
        assert torch.equal(torch.load(tmp_path / "a.pt", weights_only=True)["embedding"], weights)
        saves.save(state, tmp_path / "no-such-folder" / "b.pt")
        wait_for(saves.failed, 30, "the failed write")
        with pytest.raises(OSError, match="b.pt"):
            saves.wait()
        # a container's memory cgroup leaves 100 bytes: the 68 bytes of state would take more than half
        cgroup = memory_cgroup(tmp_path / "cgroup", "memory.max", "memory.current", 1000, 900)
        monkeypatch.setattr(checkpoints, "CGROUP", cgroup)
        saves.save(state, tmp_path / "c.pt")
        assert torch.equal(torch.load(tmp_path / "c.pt", weights_only=True)["head"], weights)
        assert tmp_path / "c.pt" not in saves.copies
