"""No silent hang: a rank stuck in the user's code, in a DataLoader worker or in validation ends every rank within
--timeout and a few seconds, and each says one line that names the stalled rank, its step and its line of code; a slow
run that moves is no stall. DataLoader workers start from a forkserver, so that none can deadlock at its start."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from processes import (
    PYTHON,
    ROOT,
    ends_every_rank_with,
    finish,
    free_port,
    python,
    run,
    start,
    steps,
)
from projects import COMMON, YOUR_CLASSIFICATION, copy_with_your_functions, launch

TIMEOUT = 10  # --timeout: every stalled run must end within it and BOUND more seconds of its stall's start
BOUND = 12
# before training the others wait for the stalled rank from the collective they reach after its stall, and the
# start-up case is timed from then (rank 0's start-up check, after its first loss): with every case starting at
# once, rank 0 reached it up to 35 s after rank 1's stall on PyTorch 2.15 (2 cores, 2026-11-26); timed from the
# stall, 23.7 to 25.4 s on 2.14 and 37 to 48 s on 2.15 at the same code
START_UP_BOUND = 20
STUCK = (
    'time.sleep(float(os.environ["STALL_SECONDS"]))  # stuck: a deadlock, a read that never returns'
)

# compute_loss and collate that stall at a chosen call, on rank 1 only
YOURS = (
    "import io\nimport time\n"
    + YOUR_CLASSIFICATION.replace(
        """def compute_loss(outputs, targets):
    return F.cross_entropy(outputs, targets)""",
        f"""def on_rank_1():
    return os.environ.get("RANK", str(dist.get_rank() if dist.is_initialized() else 0)) == "1"


LOSSES = 0


def compute_loss(outputs, targets):
    global LOSSES
    LOSSES += 1
    if not on_rank_1() and LOSSES == 1:  # the start-up check's loss: its collective comes next
        Path(os.environ["STALL_FILE"] + ".waits").write_text(str(time.time()))
    if on_rank_1() and {{when_loss}}:
        Path(os.environ["STALL_FILE"]).write_text(str(time.time()))
        {STUCK}
    return F.cross_entropy(outputs, targets)


COLLATES = 0


def collate(samples):
    global COLLATES
    COLLATES += 1
    if on_rank_1() and {{when_collate}}:
        Path(os.environ["STALL_FILE"]).write_text(str(time.time()))
        {STUCK}
    return default_collate(samples)""",
    )
    .replace(
        """def build_datasets(args):
""",
        f"""def build_datasets(args):
    if slow_start_up("build_datasets"):
        {STUCK}
""",
    )
    .replace(
        """def build_model(args, num_classes):
""",
        f"""def build_model(args, num_classes):
    if slow_start_up("build_model"):
        {STUCK}
""",
    )
    + f"""

def slow_start_up(function):
    # START_UP: "FUNCTION RANKS": those ranks take STALL_SECONDS in it (a fetch, a tokenisation pass)
    name, ranks = os.environ.get("START_UP", "- -").split()
    if name == function and ranks in ("all", os.environ.get("RANK")):
        Path(os.environ["STALL_FILE"]).write_text(str(time.time()))
        return True
    return False


def save_to_a_disk(obj, f, *args, **kwargs):
    # SAVE "stuck": rank 0's disk stops answering in its first save, half written; "slow": it writes
    # a byte of the checkpoint at a time over 1.5 x --timeout
    if os.environ.get("SAVE") is None or os.environ.get("RANK") != "0":
        return real_save(obj, f, *args, **kwargs)
    data = io.BytesIO()
    real_save(obj, data, *args, **kwargs)
    data = data.getvalue()
    if os.environ["SAVE"] == "stuck":
        f.write(data[:len(data) // 2])
        f.flush()
        Path(os.environ["STALL_FILE"]).write_text(str(time.time()))
        time.sleep(3600)  # stuck: a network file system that stopped answering
    chunks = 30
    for i in range(chunks):
        f.write(data[i * len(data) // chunks:(i + 1) * len(data) // chunks])
        f.flush()
        time.sleep(1.5 * {TIMEOUT} / chunks)


real_save = torch.save
torch.save = save_to_a_disk
"""
)

CASES = {  # name: (script, when compute_loss stalls, when collate stalls, flags, the function the line names)
    # the 4th loss: the start-up check's, then steps 1 to 3
    "compute_loss": ("distributed.py", "LOSSES == 4", "False", [], "compute_loss"),
    "collate": ("distributed.py", "False", "COLLATES == 6", [], "collate"),
    "worker": (
        "distributed.py",
        "False",
        "torch.utils.data.get_worker_info() and COLLATES == 3",
        ["--workers", "2"],
        "collate",
    ),
    "validation": ("distributed.py", "not torch.is_grad_enabled()", "False", [], "compute_loss"),
    "fsdp": ("distributed_fsdp.py", "LOSSES == 4", "False", [], "compute_loss"),
    "mp": ("distributed_mp.py", "LOSSES == 4", "False", [], "compute_loss"),
    "by_hand": ("distributed.py", "LOSSES == 4", "False", [], "compute_loss"),
    # our core copied as ddp_utils.py beside a project's own utils.py (test_distributed.py trains it with workers)
    "renamed": ("distributed.py", "LOSSES == 4", "False", [], "compute_loss"),
    # steps of 0.6 x --timeout on one rank, the others waiting for it each time: slow, not stalled
    "slow": ("distributed.py", "2 <= LOSSES <= 4", "False", ["--epochs", "1"], None),
    # every batch of rank 1 a little late: its records name it the slow one
    "slow_data": ("distributed.py", "False", "True", ["--epochs", "1", "--print-freq", "5"], None),
    # rank 1 stuck in build_model, rank 0 waiting for it in the start-up check's collective
    "start_up": ("distributed.py", "False", "False", [], "build_model"),
    # rank 0's disk stops answering in the middle of its first checkpoint
    "save": ("distributed.py", "False", "False", [], "save_to_a_disk"),
    # every rank 35 s in build_datasets: no rank waits for another, so no stall
    "slow_start": ("distributed.py", "False", "False", ["--epochs", "1"], None),
    # rank 0 alone 35 s in build_datasets, rank 1 waiting for it under --timeout 60
    "slow_start_rank_0": (
        "distributed.py",
        "False",
        "False",
        ["--epochs", "1", "--timeout", "60"],
        None,
    ),
    # a checkpoint written a byte at a time over 1.5 x --timeout: it moves
    "slow_save": ("distributed.py", "False", "False", ["--epochs", "1"], None),
}
# how long these sleep at each call; the others, for ever
SECONDS = {
    "slow": 0.6 * TIMEOUT,
    "slow_data": 0.2,
    "slow_start": 35,
    "slow_start_rank_0": 35,
    "slow_save": 0,
}
ENV = {
    "start_up": {"START_UP": "build_model 1"},
    "save": {"SAVE": "stuck"},
    "slow_start": {"START_UP": "build_datasets all"},
    "slow_start_rank_0": {"START_UP": "build_datasets 0"},
    "slow_save": {"SAVE": "slow"},
}


def user_code(name: str) -> str:
    _, loss, collate, _, _ = CASES[name]
    return YOURS.replace("{when_loss}", loss).replace("{when_collate}", collate)


@pytest.fixture(scope="module")
def stalled(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, float, Path]]:
    """Every case run at once (they mostly sleep): (its result, seconds from its stall to its end, its output dir);
    "by_hand" is two ranks started by hand, no launcher (their outputs joined)."""
    base, started = tmp_path_factory.mktemp("stalls"), {}
    for name, (script, _, _, flags, _) in CASES.items():
        folder = "ddp_utils" if name == "renamed" else "utils"
        copy = copy_with_your_functions(
            script, base / name / "copy", user_code(name), folder=folder
        )
        out, stall_file = base / name / "out", base / name / "stalled_at"
        args = [*COMMON, "--timeout", str(TIMEOUT), "--output-dir", out, *flags]
        env = {
            "STALL_FILE": str(stall_file),
            "STALL_SECONDS": str(SECONDS.get(name, 3600)),
            **ENV.get(name, {}),
        }
        if name == "by_hand":
            port = str(free_port())
            started[name] = (
                [
                    start(
                        python(copy, *args, "--ip", "127.0.0.1", "--port", port),
                        {**env, "RANK": str(rank), "WORLD_SIZE": "2"},
                    )
                    for rank in (0, 1)
                ],
                stall_file,
                out,
            )
        else:
            started[name] = ([start(launch(copy, 2, *args), env)], stall_file, out)
    ended, deadline = {}, time.monotonic() + 240
    while len(ended) < len(started) and time.monotonic() < deadline:
        for name, (procs, *_) in started.items():
            if name not in ended and all(proc.poll() is not None for proc, _ in procs):
                ended[name] = time.time()
        time.sleep(0.1)
    results = {}
    for name, (procs, stall_file, out) in started.items():
        # a run still going after 240 s fails here, with its output
        done = [finish(proc, marker, timeout=1) for proc, marker in procs]
        result = subprocess.CompletedProcess(
            done[0].args,
            max(r.returncode for r in done),
            "".join(r.stdout for r in done),
            "".join(r.stderr for r in done),
        )
        since = None
        if stall_file.exists():
            since = ended[name] - float(stall_file.read_text())
        # stuck before training, a rank is a stall once another waits for it: from then on
        waits = stall_file.with_name(stall_file.name + ".waits")
        if name == "start_up" and waits.exists():
            since = min(since, ended[name] - float(waits.read_text()))
        results[name] = (result, since, out)
    return results


# Beside another worker's tests: with the DiLoCo fixture's 4 runs at once or FSDP's phase table
# running, every stalled run ended 10.7 to 12.8 s after its stall (2 cores, 2026-11-28), well
# within TIMEOUT + BOUND; alone, the other worker sat idle for the fixture's 40 s.
@pytest.mark.parametrize("name", [name for name in CASES if name not in SECONDS])
def test_a_stalled_rank_ends_every_rank_naming_itself_its_step_and_its_line(stalled, name):
    result, since, out = stalled[name]
    script, *_, function = CASES[name]
    bound = START_UP_BOUND if name == "start_up" else BOUND
    assert since is not None and since <= TIMEOUT + bound, (since, result.stderr)
    # the line: rank 1, its epoch and step (the 4th loss is step 3's; validation after epoch 1's last step, 20)
    position = {
        "validation": "in validation after step 20 of epoch 1",
        "collate": "at step 2 of epoch 1",
        "worker": r"at step \d+ of epoch 1",
        "start_up": "before training",
        "save": "at step 20 of epoch 1",
    }.get(name, "at step 3 of epoch 1")
    lines = (out.parent / "copy" / script).read_text().splitlines()
    stuck_in = function
    begins = next(i for i, text in enumerate(lines) if text.startswith(f"def {stuck_in}("))
    line_number = next(i for i, text in enumerate(lines[begins:], begins + 1) if "# stuck:" in text)
    worker = " in a DataLoader worker" if name == "worker" else ""
    rank, what = "1", r"made no progress for \d+ s"
    if name == "save":  # rank 0, and the file it was writing
        rank, what = "0", rf"wrote nothing to {re.escape(str(out))}/checkpoint\.pt for \d+ s"
    pattern = (
        rf"error: rank {rank} {what} {position}, in {stuck_in} \({script}:{line_number}\)"
        rf"{worker}; "
        rf"the other ranks waited for it in a collective; every rank's stacks in {re.escape(str(out))}/stalls/"
    )
    if name == "mp":  # the parent says its children's line once
        assert result.returncode == 1 and re.fullmatch(
            pattern, result.stderr.strip().splitlines()[-1]
        ), result.stderr
    else:
        ends_every_rank_with(result, f"error: rank {rank} ")
        assert all(
            re.fullmatch(pattern, line)
            for line in result.stderr.splitlines()
            if line.startswith("error:")
        ), result.stderr
    assert not re.search(r'File ".*/copy/', result.stderr), (
        result.stderr
    )  # no traceback through the user's copy
    # every rank's stacks; the stalled one's show the user's function, in its worker where it waited for one
    stacks = {r: (out / "stalls" / f"rank{r}.txt").read_text() for r in (0, 1)}
    other = "1" if rank == "0" else "0"
    assert re.search(rf"in {stuck_in}\n    .*# stuck:", stacks[int(rank)]), stacks[int(rank)]
    assert "# stuck:" not in stacks[int(other)], stacks[int(other)]
    assert ("DataLoader worker (pid" in stacks[1]) == (name == "worker")


@pytest.mark.parametrize("name", SECONDS)
def test_a_slow_run_is_no_stall(stalled, name):
    result, since, out = stalled[name]
    assert result.returncode == 0, result.stderr
    assert not (out / "stalls").exists()


def test_the_records_name_the_rank_that_waited_longest_for_its_data(stalled):
    """Rank 1's batches come 0.2 s late each (its collate sleeps): every record says rank 1 waited about 5 x 0.2 s."""
    records = [record for record in steps(stalled["slow_data"][2]) if "train_loss" in record]
    assert len(records) == 4 and all(record["data_wait_rank"] == 1 for record in records), records
    assert all(0.6 <= record["data_wait_max_s"] < 3 for record in records), (
        records
    )  # the last: 4 batches read


def test_forkserver_workers_never_stick_at_start_after_a_collective(tmp_path):
    """Workers started 300 times on each of 2 ranks right after collectives whose tensors gloo's threads release (a
    thread of the stream library running too), as the scripts start them: none stuck (20 s for each first batch)."""
    code = f"""
import os, sys, threading, time
sys.path.insert(0, {str(ROOT)!r})
import torch, torch.distributed as dist
from extras import workers
from torch.utils.data import DataLoader


def monitor():  # a thread of the stream library (tqdm's monitor, say), awake now and then
    while True:
        time.sleep(0.001)


def main():
    dist.init_process_group("gloo")
    threading.Thread(target=monitor, daemon=True).start()
    for i in range(150):
        works = [dist.all_reduce(torch.ones(1), async_op=True) for _ in range(8)]  # tensors only gloo holds
        loader = DataLoader(list(range(8)), batch_size=2, num_workers=2, timeout=20, worker_init_fn=workers.init_worker,
                            multiprocessing_context=workers.worker_start(2))
        del works
        next(iter(loader))
    print("started", i + 1, flush=True)
    os._exit(0)


if __name__ == "__main__":  # the forkserver imports this file, as it imports a script
    main()
"""
    script = tmp_path / "start_workers.py"
    script.write_text(code)
    result = run(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script],
        timeout=240,
    )
    assert result.stdout.count("started 150") == 2, result.stdout


def test_a_dataset_that_cannot_go_to_a_worker_ends_every_rank_with_one_line(tmp_path):
    """Workers start from a forkserver, so what they run must pickle: a lambda in the Dataset is named before
    training, in one line on every rank, where a fork took it and a forkserver would fail with a traceback."""
    lambda_inside = YOUR_CLASSIFICATION.replace(
        """def build_datasets(args):
    return Blobs(640, seed=1), Blobs(203, seed=2), 4""",
        """def build_datasets(args):
    train = Blobs(640, seed=1)
    train.transform = lambda x: x
    return train, Blobs(203, seed=2), 4""",
    )
    copy = copy_with_your_functions("distributed.py", tmp_path / "copy", lambda_inside)
    result = run(
        launch(copy, 2, *COMMON, "--workers", "2", "--output-dir", tmp_path / "out"), check=False
    )
    ends_every_rank_with(
        result,
        "error: the Dataset or collate cannot go to a DataLoader worker (Can't pickle local "
        "object 'build_datasets.<locals>.<lambda>'): define their functions at module level",
    )
