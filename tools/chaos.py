"""Faults one after another, at random moments: an elastic run of distributed.py, launched as
docs/launching.md tells users (the rendezvous store on a host of its own, one torchrun agent a node,
checkpoints every few steps), driven through a seeded schedule of faults, some landing while the
last is still being recovered from. When it ends, its weights and records are compared with a
straight run of the same command: the promise is that whatever happened, they are the same.

    python tools/chaos.py --faults 20 --seed 1     # a long schedule (a few minutes on 2 cores)
    python tools/chaos.py --faults 3 --seed 7 --only kill_rank,preempt

The faults (--only picks some):
- kill_rank: SIGKILL one training process; its agent restarts the processes of every node.
- replace_node: SIGKILL a whole agent with its process (a node lost), and start a new agent (a node
  joining).
- preempt: SIGTERM every agent (as a scheduler preempts a job), wait for them to end, start them
  again with the same command (under a new rendezvous id: the old one is closed).
- stall: SIGSTOP one training process past --timeout, SIGCONT it later; the watchdog ends the ranks.
- kill_loader_worker: SIGKILL one DataLoader worker of a training process.
- full_disk: fill the file system of the output (a tmpfs of its own: needs root) so that a
  checkpoint cannot be written, and free it a few seconds later.

Left out by design: SIGKILL of the rendezvous store. It is the one place the agents meet; without
it no agent can restart or admit a node, which is why docs/launching.md keeps it on an always-on
host apart from the training nodes.

It prints each fault (when, what, the step it met, the steps trained again, the seconds until the
run trained past that step again), then the comparison, and exits non-zero where the run did not
end with the straight run's weights (1e-5) and records (each step and epoch once, 1e-6). A failure
is replayed by the same --faults, --seed and --only.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

sys.path[:0] = [str(Path(__file__).resolve().parent)]
from processes import (  # noqa: E402
    AGENT_ENV,
    MARKER,
    MEASURED,
    ROOT,
    TINY,
    assert_same_records,
    elastic_agent,
    free_port,
    kill_everything_started_by,
    listening,
    max_weight_difference,
    metrics,
    processes_with_marker,
    rendezvous_store,
    run,
    steps,
    torchrun,
    trained_steps,
    training_processes,
    wait_for,
)

FAULTS = ("kill_rank", "replace_node", "preempt", "stall", "kill_loader_worker", "full_disk")
LEFT_OUT = {
    "kill_store": "the rendezvous store is where every agent meets: without it none can restart"
    " or admit a node (docs/launching.md keeps it on an always-on host of its own)",
}
NODES = 2  # agents in the run; a replaced node's agent joins as another leaves
STALL_TIMEOUT = 10  # --timeout: a rank without progress for that long ends every rank


def job(faults: int) -> list:
    """The run's flags: the tiny job, one DataLoader worker a process, a checkpoint every 8 steps,
    long enough for the faults to land while it trains (62 steps an epoch)."""
    return [
        *TINY,
        "--fake-size",
        "2000",
        "--epochs",
        str(2 + faults // 2),
        "--workers",
        "1",
        "--print-freq",
        "4",
        "--save-every",
        "8",
        "--timeout",
        str(STALL_TIMEOUT),
    ]


class Run:
    """The elastic run under faults: its agents (each a torchrun process and what it started,
    found by a marker in their environment), their logs, and the run's progress over time."""

    def __init__(self, port: int, out: Path, flags: list, logs: Path):
        self.port, self.out, self.flags, self.logs = port, out, flags, logs
        self.generation = 0  # a preemption closes a rendezvous: the next one has a new id
        self.agents: list[tuple[subprocess.Popen, str]] = []
        self.timeline: list[tuple[float, int]] = []  # (seconds, the last step recorded)
        self.started = time.monotonic()
        self.done = threading.Event()
        threading.Thread(target=self.watch, daemon=True).start()

    def watch(self) -> None:
        """The last recorded step, every 50 ms (a continuation rewrites steps.jsonl back to its
        checkpoint: the drop shows the steps trained again)."""
        while not self.done.is_set():
            try:
                self.timeline.append((self.now(), trained_steps(self.out)))
            except (OSError, ValueError):  # a line being written
                pass
            time.sleep(0.05)

    def now(self) -> float:
        return time.monotonic() - self.started

    def progress(self) -> int:
        return self.timeline[-1][1] if self.timeline else 0

    def start_agent(self) -> None:
        marker = uuid.uuid4().hex
        command = elastic_agent(
            self.port,
            f"chaos-{self.generation}",
            f"1:{NODES + 1}",
            1000,
            "distributed.py",
            *self.flags,
            "--output-dir",
            self.out,
        )
        # the agent writes into its own copy of the file: this one is closed at once
        with open(self.logs / f"agent-{len(list(self.logs.iterdir()))}.log", "w") as log:
            proc = subprocess.Popen(
                [str(c) for c in command],
                cwd=ROOT,
                env={**os.environ, **AGENT_ENV, "PYTHONUNBUFFERED": "1", MARKER: marker},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.agents.append((proc, marker))

    def ranks(self) -> list[int]:
        return [
            pid for _, marker in self.agents for pid in training_processes(marker, "distributed.py")
        ]

    def loader_workers(self) -> list[int]:
        """The DataLoader workers: children of a forkserver that a training process started."""
        found = []
        for _, marker in self.agents:
            for pid in processes_with_marker(marker):
                try:
                    parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                    if b"forkserver" in Path(f"/proc/{parent}/cmdline").read_bytes():
                        found.append(pid)
                except (OSError, IndexError, ValueError):
                    pass
        return found

    def kill(self) -> None:
        self.done.set()
        for _, marker in self.agents:
            kill_everything_started_by(marker)


def ended(run: Run) -> bool:
    """Has every agent ended (the run done, or a fault ended it)?"""
    return all(proc.poll() is not None for proc, _ in run.agents)


def one_of(find, share: float, what: str, timeout: float = 60) -> int:
    """The process at share (in [0, 1), drawn from the schedule) of those find() lists, in order,
    waiting for one (a restart in progress) up to timeout."""
    found: list[int] = []

    def listed() -> bool:
        found[:] = sorted(find())
        return bool(found)

    wait_for(listed, timeout, what)
    return found[int(share * len(found))]


def signal_pid(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def inject(kind: str, run: Run, share: float, seconds: float, disk: Path | None) -> str:
    """One fault; what it hit (its target at share of the candidates; a full disk for seconds)."""
    if kind == "kill_rank":
        pid = one_of(run.ranks, share, "a training process")
        signal_pid(pid, signal.SIGKILL)
        return f"pid {pid}"
    if kind == "replace_node":
        proc, marker = run.agents.pop(int(share * len(run.agents)))
        kill_everything_started_by(marker)
        run.start_agent()
        return f"agent {proc.pid}"
    if kind == "preempt":
        for proc, _ in run.agents:
            signal_pid(proc.pid, signal.SIGTERM)
        for proc, marker in run.agents:
            try:
                proc.wait(timeout=120)
            finally:
                kill_everything_started_by(marker)
        run.agents.clear()
        run.generation += 1
        for _ in range(NODES):
            run.start_agent()
        return f"{NODES} agents"
    if kind == "stall":
        pid = one_of(run.ranks, share, "a training process")
        signal_pid(pid, signal.SIGSTOP)
        threading.Timer(STALL_TIMEOUT + 3, signal_pid, (pid, signal.SIGCONT)).start()
        return f"pid {pid} for {STALL_TIMEOUT + 3} s"
    if kind == "kill_loader_worker":
        pid = one_of(run.loader_workers, share, "a DataLoader worker")
        signal_pid(pid, signal.SIGKILL)
        return f"pid {pid}"
    if kind == "full_disk":
        stats = os.statvfs(disk)
        filler = disk / f"filler-{uuid.uuid4().hex}"
        # room for the records (a line of a few hundred bytes), none for a checkpoint (~430 KB)
        filler.write_bytes(b"\0" * max(0, stats.f_bavail * stats.f_frsize - 64 * 1024))
        threading.Timer(seconds, filler.unlink).start()
        return f"for {seconds:.1f} s"
    raise ValueError(kind)


def recovery(run: Run, at: float, until: float, step: int) -> tuple[float | None, int]:
    """(seconds from the fault until the run trained past the furthest step it had recorded before
    it went back to a checkpoint, None if it never did; the steps it trained again). A continuation
    rewrites steps.jsonl back to its checkpoint: the first drop of the last recorded step between
    this fault and the next is this fault's (a full disk shows at the next save, not at once)."""
    window = [(t, s) for t, s in run.timeline if at <= t < until]
    drop = next((i for i in range(1, len(window)) if window[i][1] < window[i - 1][1]), None)
    peak, lowest, since = step, step, at
    if drop is not None:
        peak = max(s for _, s in window[:drop])
        lowest = min(s for _, s in window[drop:])
        since = window[drop][0]
    back = next((t for t, s in run.timeline if t >= since and s > peak), None)
    return (None if back is None else back - at), peak - lowest


def without_norms(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "grad_norm"} for r in records]


def same_epochs(records: list[dict], expected: list[dict], tolerance: float) -> None:
    """metrics.jsonl: the same epochs, each once, with the same learned numbers."""
    assert [r["epoch"] for r in records] == [r["epoch"] for r in expected], (records, expected)
    for record, other in zip(records, expected):
        for key in record.keys() - MEASURED:
            assert record[key] == pytest.approx(other[key], abs=tolerance), (key, record, other)


def small_disk(base: Path) -> Path | None:
    """A 16 MB tmpfs under base for the run's output, to fill; None where it cannot be mounted."""
    mount_point = base / "disk"
    mount_point.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return None
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", mount_point],
        capture_output=True,
        timeout=30,
    )
    return mount_point if made.returncode == 0 else None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=20, help="faults to inject (default 20)")
    parser.add_argument("--seed", type=int, default=1, help="the schedule's seed (default 1)")
    parser.add_argument(
        "--only", default=",".join(FAULTS), help=f"faults to draw from, comma-separated: {FAULTS}"
    )
    parser.add_argument(
        "--keep", type=Path, default=None, help="keep the runs' folders and agents' logs here"
    )
    args = parser.parse_args(argv)
    args.only = args.only.split(",")
    unknown = set(args.only) - set(FAULTS)
    if unknown:
        parser.error(f"unknown faults {sorted(unknown)}; known: {FAULTS}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    base = Path(args.keep or tempfile.mkdtemp(prefix="chaos-"))
    base.mkdir(parents=True, exist_ok=True)
    (base / "logs").mkdir()
    disk = small_disk(base)
    try:
        code = schedule(args, base, disk)
    finally:
        if disk is not None:
            subprocess.run(["umount", "-l", disk], capture_output=True, timeout=30)
    if code == 0 and args.keep is None:
        shutil.rmtree(base, ignore_errors=True)
    return code


def schedule(args: argparse.Namespace, base: Path, disk: Path | None) -> int:
    """The run through the schedule's faults, the straight run beside it, and their comparison."""
    rng = random.Random(args.seed)
    kinds = list(args.only)
    if disk is None and "full_disk" in kinds:
        kinds.remove("full_disk")
        print("left out: full_disk (mounting a small tmpfs needs root)")
    for kind, why in LEFT_OUT.items():
        print(f"left out: {kind} ({why})")
    flags = job(args.faults)
    out = (disk or base) / "run"
    straight = base / "straight"
    reference = threading.Thread(
        target=run,
        args=(torchrun(2, "distributed.py", *flags, "--output-dir", straight),),
        kwargs=dict(timeout=1800),
    )
    reference.start()
    port = free_port()
    store = subprocess.Popen(rendezvous_store(port), start_new_session=True)
    wait_for(lambda: listening(port), 60, "the store")
    chaos = Run(port, out, flags, base / "logs")
    failed = ""
    try:
        for _ in range(NODES):
            chaos.start_agent()
        wait_for(lambda: chaos.progress() >= 4, 300, "the first steps")
        injected, last, recovering = [], 0, 0
        for number in range(1, args.faults + 1):
            # a third of the faults land soon after the last, while it is still being recovered
            # from; the others once the run trains past the last one's step again, a moment later
            # the schedule, from the seed alone: the same draws whatever the run's timing
            soon = rng.random() < 1 / 3
            pause = rng.uniform(0.2, 1.5) if soon else rng.uniform(0, 3)
            kind, share, seconds = rng.choice(kinds), rng.random(), rng.uniform(2, 6)
            if not soon:
                wait_for(lambda: chaos.progress() > last or ended(chaos), 600, "a recovery")
            time.sleep(pause)
            if ended(chaos):
                print(f"the run ended after {number - 1} faults: lengthen it")
                break
            at, step = chaos.now(), chaos.progress()
            what = inject(kind, chaos, share, seconds, disk)
            recovering += soon
            injected.append((number, kind, what, at, step))
            last = step
            print(f"fault {number}: {kind} ({what}) at {at:.1f} s, step {step}", flush=True)
        for proc, marker in chaos.agents:
            code = proc.wait(timeout=1800)
            if code != 0:
                failed = f"agent {proc.pid} exited {code} (logs in {base / 'logs'})"
        reference.join()
    finally:
        chaos.kill()
        store.kill()
    print("\n| fault | kind | what | at s | step | steps again | recovered in s |")
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: |")
    for i, (number, kind, what, at, step) in enumerate(injected):
        until = injected[i + 1][3] if i + 1 < len(injected) else float("inf")
        seconds, again = recovery(chaos, at, until, step)
        shown = "-" if seconds is None else f"{seconds:.1f}"
        print(f"| {number} | {kind} | {what} | {at:.1f} | {step} | {again} | {shown} |")
    kinds_seen = sorted({kind for _, kind, *_ in injected})
    print(
        f"\n{len(injected)} faults ({', '.join(kinds_seen)}), {recovering} of them while the last"
        f" was recovered from, seed {args.seed}"
    )
    if not failed:
        difference = max_weight_difference(out, straight)
        try:
            records, expected = steps(out), steps(straight)
            assert_same_records(without_norms(records), without_norms(expected), tolerance=1e-6)
            # the gradients' norm of each training record by its step (a validation record has
            # none), a float32 of weights made on 1 to 3 ranks in turn: to 1e-5 of it
            norms = [
                {r["global_step"]: r["grad_norm"] for r in rs if r.get("grad_norm") is not None}
                for rs in (records, expected)
            ]
            assert norms[0] == pytest.approx(norms[1], rel=1e-5), norms
            same_epochs(metrics(out), metrics(straight), tolerance=1e-6)
        except AssertionError as e:
            failed = f"records differ from the straight run's: {str(e)[:2000]}"
        print(f"max weight difference to the straight run: {difference:.1e}")
        if difference > 1e-5:
            failed = failed or f"weights differ from the straight run's by {difference:.1e}"
    if failed:
        print(
            f"FAILED: {failed}\nreplay: python tools/chaos.py --faults {args.faults} --seed "
            f"{args.seed} --only {','.join(args.only)}"
        )
        return 1
    print("every fault survived: the straight run's weights and records, each step once")
    return 0


if __name__ == "__main__":
    sys.exit(main())
