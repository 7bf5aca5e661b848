"""Start the scripts as users do and read what they write; shared by the tests and
the benchmark. Every run has a timeout, and whatever it started is killed
afterwards: torchrun puts its workers in sessions of their own, so they are
found by a marker in their environment, not by process group."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

import warm_ranks

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


class RunFailed(AssertionError):
    """A command failed or timed out (an AssertionError, so pytest reports it plainly)."""


# a tiny, fast, exactly reproducible job; its 1035 // 5 = 207 validation images
# do not split evenly over 2 processes; with a moving average of the weights, which every equality checks too
TINY = [
    "--dataset",
    "fake",
    "--arch",
    "tiny",
    "--fake-size",
    "1035",
    "--image-size",
    "16",
    "--batch-size",
    "32",
    "--epochs",
    "3",
    "--workers",
    "0",
    "--print-freq",
    "10",
    "--timeout",
    "60",
    "--ema",
    "0.9",
]
# with augmentation and the default recipe; epochs of about 2 s on 2 cores, to stop or kill in the middle of one
LONG = [*TINY, "--fake-size", "8000", "--epochs", "2", "--print-freq", "50"]
# the README's main job (ResNet-18 on fake images, 16 steps an epoch) without its --epochs 3
README_JOB = [
    "--dataset",
    "fake",
    "--fake-size",
    "1024",
    "--image-size",
    "16",
    "--arch",
    "resnet18",
    "--batch-size",
    "64",
    "--ema",
    "0.9",
    "--workers",
    "0",
]
EVAL_EVERY = [
    "--eval-every",
    "12",
]  # and validated mid-epoch: at steps 12 and 24 of each epoch's 32
MARKER = "DDP_SCRIPTS_TEST_RUN"
# W&B without a network: each run of a command with --wandb writes OUTPUT_DIR/wandb/offline-run-*/, every 15 s
OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def processes_with_marker(marker: str) -> list[int]:
    """PIDs of every live process whose environment carries marker."""
    needle = f"{MARKER}={marker}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


def kill_everything_started_by(marker: str) -> None:
    warm = WARM_RUNS.pop(marker, None)
    if warm is not None:
        warm.kill()
    for _ in range(10):
        pids = processes_with_marker(marker)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


STARTED: list[str] = []  # markers of this test's processes, all killed when it ends


# Under pytest (conftest.py), `python SCRIPT` and torchrun's `--standalone` start warm
# (tools/warm_ranks.py) unless a test is marked real_launch or DDP_TESTS_COLD is set; the tools run
# by hand (the benchmark: its speed and memory are a user's launch) start every command the real way,
# unless DDP_TESTS_WARM=1 (a test that checks a tool's output, not its speed).
WARM_BY_DEFAULT = os.environ.get("DDP_TESTS_WARM") == "1"
WARM = WARM_BY_DEFAULT
WARM_RUNS: dict[str, warm_ranks.WarmRun] = {}


@contextlib.contextmanager
def warm_starts():
    """In a test marked real_launch, the commands started inside start warm as in any other test:
    those whose launch is not what it checks."""
    global WARM
    before, WARM = WARM, WARM_BY_DEFAULT
    try:
        yield
    finally:
        WARM = before


def start(
    cmd: list[str], env: dict | None = None, cwd: Path = ROOT
) -> tuple[subprocess.Popen | warm_ranks.WarmRun, str]:
    """Start cmd (in the repository root unless told); returns the process and its kill marker.
    A script started with `python` or torchrun's `--standalone` is forked from a process that has
    imported torch (warm_ranks), unless WARM is off: a test of the launch itself."""
    marker = uuid.uuid4().hex
    STARTED.append(marker)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", MARKER: marker, **(env or {})}
    if WARM:
        proc = warm_ranks.start(cmd, full_env, cwd, free_port())
        if proc is not None:
            WARM_RUNS[marker] = proc
            return proc, marker
    proc = subprocess.Popen(
        [str(c) for c in cmd],
        cwd=cwd,
        env=full_env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    return proc, marker


def finish(proc: subprocess.Popen, marker: str, timeout: float) -> subprocess.CompletedProcess:
    """Wait for proc; on timeout kill its whole tree and fail the test."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_everything_started_by(marker)
        out, err = proc.communicate()
        raise RunFailed(
            f"{' '.join(map(str, proc.args))} timed out after {timeout} s\n{out}\n{err}"
        )
    finally:
        kill_everything_started_by(marker)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run(
    cmd: list, timeout: float = 180, env: dict | None = None, check: bool = True, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    result = finish(*start(cmd, env, cwd), timeout)
    if check and result.returncode != 0:
        raise RunFailed(
            f"{' '.join(map(str, result.args))} exited {result.returncode}\n"
            f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
        )
    return result


def run_parallel(
    cmds: list[tuple], timeout: float = 180, cwd: Path = ROOT, check: bool = True, at_once: int = 0
) -> list[subprocess.CompletedProcess]:
    """Start several commands (each with its environment, and its own folder where a third item names one) at once,
    or at_once of them at a time (memory: each run's processes and workers hold a few hundred MB): the nodes of one
    job, or independent runs that share the cores better than in turn; wait for all."""
    results, waves = (
        [],
        [cmds[i : i + at_once] for i in range(0, len(cmds), at_once)] if at_once else [cmds],
    )
    for wave in waves:
        started = [start(cmd, env, *folder or [cwd]) for cmd, env, *folder in wave]
        results += [finish(proc, marker, timeout) for proc, marker in started]
    for r in results:
        if check and r.returncode != 0:
            raise RunFailed(
                f"{' '.join(map(str, r.args))} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
            )
    return results


def python(script: str, *args) -> list:
    return [PYTHON, script, *args]


def torchrun(nproc: int, script: str, *args) -> list:
    return [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        script,
        *args,
    ]


def rendezvous_store(port: int) -> list:
    """PyTorch's own TCPStore alone, as on a small always-on host: no training node holds the
    rendezvous (docs/launching.md)."""
    code = (
        "import time, torch.distributed as dist\n"
        f"store = dist.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False)\n"
        "time.sleep(3600)\n"
    )
    return [PYTHON, "-c", code]


# every elastic agent, as docs/launching.md starts them: workers' store made anew each round (else a
# joining agent waits for the address the first round published)
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def elastic_agent(port: int, rdzv_id: str, nodes: str, restarts: int, *script_args) -> list:
    """A node's torchrun agent, one process, elastic over nodes ("1:2") that meet at the store on
    port, restarting its process up to restarts times."""
    return [
        PYTHON,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nodes}",
        "--nproc-per-node=1",
        f"--max-restarts={restarts}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={rdzv_id}",
        "--rdzv-conf=is_host=false,last_call_timeout=2",
        "--monitor-interval=1",
        *script_args,
    ]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def trained_steps(out: Path) -> int:
    """The last step steps.jsonl records trained (0 before any)."""
    if not (out / "steps.jsonl").exists():
        return 0
    return max([r["global_step"] for r in steps(out) if "train_loss" in r], default=0)


# Ports for the runs' rendezvous, 20000 to 27999: below the kernel's ephemeral range, where a port
# found free (bind to 0) can be handed to another connection (gloo's, a neighbour's) before the run
# binds it, and below the scripts' default 29500. Each pytest-xdist worker takes its own 1000 of
# them in turn, from where this process's id falls.
RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
OWN_PORTS = RANGE.exists() and int(RANGE.read_text().split()[0]) >= 28000
WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
PORTS = itertools.count(os.getpid() % 1000)


def free_port() -> int:
    """A port no other run of the suite is given, bound and released here to see that it is free."""
    for _ in range(1000):
        port = 20000 + 1000 * (WORKER % 8) + next(PORTS) % 1000
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port if OWN_PORTS else 0))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port from 20000 to 27999")


def weights(output_dir: Path) -> dict[str, torch.Tensor]:
    """The trained weights: checkpoint.pt's, or distributed_fsdp.py's model.pt beside its sharded checkpoint; on the
    CPU (a GPU run's checkpoint.pt holds them where they trained, FSDP's model.pt on the CPU)."""
    checkpoint = Path(output_dir) / "checkpoint.pt"
    if checkpoint.exists():
        return torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]
    return torch.load(Path(output_dir) / "model.pt", map_location="cpu", weights_only=True)


def max_weight_difference(dir_a: Path, dir_b: Path) -> float:
    """Of the trained weights, and of their --ema average (model_ema.pt) where either run kept one."""
    pairs = [(weights(dir_a), weights(dir_b))]
    if any((Path(d) / "model_ema.pt").exists() for d in (dir_a, dir_b)):  # then both must have it
        pairs.append(
            tuple(
                torch.load(Path(d) / "model_ema.pt", map_location="cpu", weights_only=True)
                for d in (dir_a, dir_b)
            )
        )
    assert all(a.keys() == b.keys() for a, b in pairs)
    return max((a[k].double() - b[k].double()).abs().max().item() for a, b in pairs for k in a)


def metrics(output_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    lines = (Path(output_dir) / name).read_text().splitlines()
    return [json.loads(line) for line in lines]


def steps(output_dir: Path) -> list[dict]:
    """steps.jsonl: the training and validation records every few steps."""
    return metrics(output_dir, "steps.jsonl")


MEASURED = {
    "epoch_time_s",
    "images_per_s",
    "items_per_s",
    "data_wait_s",
    "data_wait_max_s",
    "data_wait_rank",
    "peak_mem_mb",
    "tflops",
    "world_size",
    "phase_ms",
    "slow",
}  # vary per run (the world size: the same records on any)


OWN = {
    "sent_mb_per_step",
    "val_weights_step",
}  # keys of DiLoCo's records alone: what it sent, what it validated


def assert_same_records(records: list[dict], expected: list[dict], tolerance: float) -> None:
    """The same records at the same steps (each once), with the same keys (an approach's own aside); learned numbers
    within tolerance."""
    keys = [[(r["global_step"], sorted(r.keys() - OWN)) for r in rs] for rs in (records, expected)]
    assert keys[0] == keys[1]
    for record, other in zip(records, expected):
        for key in record.keys() - MEASURED - OWN:
            assert record[key] == pytest.approx(other[key], abs=tolerance), (key, record, other)


def ends_every_rank_with(result: subprocess.CompletedProcess, line: str, ranks: int = 2) -> None:
    """A non-zero exit and a line starting with line, run into no other: under torchrun said once, and its cause in
    torchrun's summary once a rank (each rank ended with it, the node's first said it); without a launcher (ranks
    started by hand, their outputs joined), said by each. No Python traceback from the script (torchrun then prints
    its own about a failed worker)."""
    torchrun = "torch.distributed.run" in map(str, result.args)
    said = [text for text in result.stderr.splitlines() if text.startswith(line)]
    # as often as line occurs at all: none ran into the end of another line
    assert result.returncode != 0 and len(said) == result.stderr.count(line), result.stderr
    assert len(said) == (1 if torchrun else ranks), result.stderr
    if torchrun:
        cause = f"  traceback : {line.removeprefix('error: ')}"
        summary = [text for text in result.stderr.splitlines() if text.startswith(cause)]
        assert len(summary) == ranks, result.stderr
    assert (
        'distributed.py", line' not in result.stderr
        and 'distributed_fsdp.py", line' not in result.stderr
    )


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RunFailed(f"gave up after {timeout} s waiting for {what}")
        time.sleep(0.05)


def training_processes(marker: str, script: str) -> list[int]:
    """The PIDs of the processes that run script (or spawn_main) themselves, not their launcher."""
    pids = []
    for pid in processes_with_marker(marker):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        head = argv[:6]  # python [-u] SCRIPT, or python [-B] [-W FILTER] -c "...spawn_main..."
        if any(script.encode() in a for a in head) and b"torch.distributed.run" not in head:
            pids.append(pid)
    return pids


def wandb_records(path: Path) -> list:
    """The records of an offline run's run-ID.wandb (wandb ships no reader): LevelDB's log format, a 7-byte file
    header, then blocks of 32 KiB, each record in chunks behind a 7-byte header (CRC, length, type: 1 whole, 2 first,
    3 middle, 4 last); a block's last 6 bytes or fewer are padding. A file cut short by a kill ends at its last whole
    record."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, position, chunks, records = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B" or not data, data[
        :7
    ]  # empty: killed before W&B's service wrote anything
    while position + 7 <= len(data):
        if (left := 32768 - position % 32768) < 7:
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if position + 7 + length > len(data):
            break
        chunks, position = (
            chunks + data[position + 7 : position + 7 + length],
            position + 7 + length,
        )
        if kind in (1, 4):
            records.append(Record.FromString(chunks))
            chunks = b""
    return records


def wandb_runs(output_dir: Path) -> list[tuple[str, list[dict]]]:
    """Each offline run's (id, history rows), oldest first; a row without W&B's own _step, _runtime, _timestamp."""
    runs = []
    for path in sorted(output_dir.glob("wandb/offline-run-*/run-*.wandb")):
        items = [
            [
                (item.key or "/".join(item.nested_key), json.loads(item.value_json))
                for item in r.history.item
            ]
            for r in wandb_records(path)
            if r.WhichOneof("record_type") == "history"
        ]  # "a/b" comes as parts
        rows = [{key: value for key, value in row if not key.startswith("_")} for row in items]
        runs.append((path.stem.removeprefix("run-"), rows))
    return runs


def assert_wandb_equals_the_records(output_dir: Path, runs: int) -> None:
    """W&B holds one run, continued by each run of the command. Its last run of the command logged every record of
    steps.jsonl, once and in order, and after each epoch's last validation that epoch's line of metrics.jsonl (under
    epoch/); each row that an earlier one logged (what its service wrote before a kill) is one of those, equal."""
    found, records = wandb_runs(output_dir), steps(output_dir)
    assert len(found) == runs and len({run_id for run_id, _ in found}) == 1, found
    expected, epochs = [], metrics(output_dir)
    last = {
        record["epoch"]: record["step"] for record in records
    }  # each epoch's last step (records are in order)
    for record in records:
        expected.append(
            {key: value for key, value in record.items() if key not in ("epoch", "step")}
        )
        if "val_loss" in record and record["step"] == last[record["epoch"]]:
            epoch = epochs[record["epoch"] - 1]
            expected.append(
                {
                    "global_step": record["global_step"],
                    **{f"epoch/{key}": value for key, value in epoch.items()},
                }
            )
    expected = [
        {key: value for key, value in row.items() if isinstance(value, (int, float))}
        for row in expected
    ]
    assert [sorted(row) for row in found[-1][1]] == [sorted(row) for row in expected]
    for row, wanted in zip(found[-1][1], expected):
        assert_same_row(row, wanted)
    at = {(row["global_step"], tuple(sorted(row))): row for row in expected}
    for row in [row for _, rows in found[:-1] for row in rows]:
        assert_same_row(row, at[row["global_step"], tuple(sorted(row))])


def assert_same_row(
    row: dict, wanted: dict
) -> None:  # the learned values; a killed run's speed and memory differ
    learned = {key for key in wanted if key.removeprefix("epoch/") not in MEASURED}
    assert {k: row[k] for k in learned} == pytest.approx(
        {k: wanted[k] for k in learned}, rel=1e-6
    ), row


SUBNET = "10.231.7"  # private addresses that exist only inside these namespaces


def ip(*args: str) -> None:
    """iproute2's command, tried three times (two tests adding namespaces at once may race on
    /run/netns), and its own error said where it still fails."""
    for _ in range(3):
        result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
        if result.returncode == 0:
            return
        time.sleep(0.5)
    raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def can_make_hosts() -> bool:  # network namespaces need root and iproute2
    return os.geteuid() == 0 and shutil.which("ip") is not None


@contextlib.contextmanager
def two_hosts():
    """Two hosts on one machine, network namespaces joined by a veth pair: [(namespace, address, interface)] for
    host 0 and host 1, removed afterwards."""
    tag = os.getpid() % 100_000
    hosts = [(f"ddp{tag}n{i}", f"{SUBNET}.{i + 1}", f"ve{tag}n{i}") for i in (0, 1)]
    try:
        for namespace, _, _ in hosts:
            ip("netns", "add", namespace)
        ip("link", "add", hosts[0][2], "type", "veth", "peer", "name", hosts[1][2])
        for namespace, address, interface in hosts:
            ip("link", "set", interface, "netns", namespace)
            ip("-n", namespace, "addr", "add", f"{address}/24", "dev", interface)
            ip("-n", namespace, "link", "set", interface, "up")
            ip("-n", namespace, "link", "set", "lo", "up")
        yield hosts
    finally:
        for namespace, _, _ in hosts:  # deleting a namespace deletes its end of the veth
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)


def on_host(host, *cmd) -> tuple[list, dict]:
    namespace, _, interface = host
    # gloo must use the link between the hosts, not the loopback device
    return ["ip", "netns", "exec", namespace, PYTHON, *cmd], {"GLOO_SOCKET_IFNAME": interface}
