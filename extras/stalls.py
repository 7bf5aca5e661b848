"""No silent hang: a watchdog that ends every rank of a stalled run with one line naming the stalled
rank, its step and its line of code.

A script starts it in one line of main(), after the process group and the output folder, and holds
it; it closes as main ends (run_main's teardown):

    watchdog = teardown.enter_context(stalls.Watchdog(args.timeout, output_dir, rank))

The run tells it what it does, and nothing else does: watchdog.batch(epoch, step) for each
training batch (the script's train_one_epoch), watchdog.batch() for each validation batch (its
evaluate), and a save writes under watchdog.writing(path, growing)
(checkpoints.save_checkpoint(..., watchdog) does it).

The rule (docs/reliability.md):
- before the first training step, work every rank does (data, model, a checkpoint's load, a compile)
  takes as long as it takes: a rank stalls only when another has waited --timeout seconds for it in
  a collective;
- from the first step on, --timeout seconds without a batch of training or validation on any rank is
  a stall (a compile is progress, however long);
- a save is progress while its file (or folder) grows: one that wrote nothing for --timeout seconds
  is a stall, named with the file. The ranks learn of each other through the rendezvous store, never
  a collective (that is what waits): a beat every few seconds, none per step. Each rank writes the
  stacks of its threads, and of its DataLoader workers, to OUTPUT_DIR/stalls/.
"""

from __future__ import annotations

import contextlib
import datetime
import re
import faulthandler
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from utils import first_line, first_to_say, record_for_torchrun, user_frame, world_size, write_line

# Collectives wait this much longer than --timeout, so that the watchdog speaks first: the scripts
# give init_process_group timeout + timedelta(seconds=30) (tests/test_your_own_data.py checks it).
GRACE = datetime.timedelta(seconds=30)


class Watchdog(contextlib.AbstractContextManager):
    """Watches this rank's progress from a thread of its own, and ends every rank of a stalled
    run; a context manager, closed as main ends. say: where the stall's line goes (stderr, or
    distributed_mp.py's parent). Its worker_stacks, what this rank's DataLoader workers are doing,
    are none until a script sets workers.worker_stacks there."""

    def __init__(
        self,
        timeout: float,
        output_dir: Path,
        rank: int,
        say: Callable[[str], object] = write_line,
    ):
        self.timeout = timeout
        self.say = say
        # this rank's DataLoader workers' stacks, (pid, frames, text) each: workers.worker_stacks
        self.worker_stacks: Callable[[], list] = list
        self.stacks_dir = Path(output_dir) / "stalls"
        self.rank = rank
        self.world_size = world_size()
        self.main_thread = threading.main_thread().ident
        # Where this rank is: the last training batch's (epoch, step), None before training.
        self.epoch_step: tuple[int, int] | None = None
        self.validating = False
        self.val_batches = 0  # the validation's batches so far
        # The save in progress: the path it names, the file or folder that grows, its size.
        self.saving: Path | None = None
        self.growing: Path | None = None
        self.saved_bytes = 0
        self.saving_thread = self.main_thread
        self.saving_position = ""
        # This rank's last progress, and any rank's as far as this one knows.
        self.moved_at = time.monotonic()
        self.anyone_moved_at = self.moved_at
        self.moved_since_beat = False
        # Before training: the collectives this rank has counted in the store, and since when it
        # waits.
        self.counted = 0
        self.counted_after_first_step = False
        self.waiting_since: float | None = None
        self.beats = 0
        self.closed = False
        self.ending = False
        # The store the process group met in, under a prefix of its own (a torchrun restart's is
        # new).
        self.store = None
        if self.world_size > 1:
            store = default_store()
            if store is not None:
                self.store = dist.PrefixStore("watchdog/", store)
        self.woken = threading.Event()  # close() wakes the thread from its beat's wait
        self.thread = threading.Thread(target=self.watch, name="watchdog", daemon=True)
        self.thread.start()

    def __exit__(self, *exc_info) -> None:
        self.close()

    def batch(self, epoch: int | None = None, step: int | None = None) -> None:
        """A batch arrived: of training, at (epoch, step); of validation, with no arguments."""
        self.note_progress()
        self.validating = epoch is None and self.epoch_step is not None
        self.val_batches = self.val_batches + 1 if self.validating else 0
        if epoch is not None:
            self.epoch_step = (epoch, step)

    @contextlib.contextmanager
    def writing(self, path: Path, growing: Path | None = None):
        """A save writes path within; growing is the file or folder that grows meanwhile."""
        self.saving = Path(path)
        self.growing = Path(growing or path)
        self.saved_bytes = 0
        # written by a thread of its own (checkpoints.Saves) while training goes on: that thread's
        # line is the one to name, and the step the save was taken at (save_taken)
        self.saving_thread = threading.get_ident()
        if self.saving_thread == self.main_thread:
            self.save_taken()
        self.note_progress()
        try:
            yield
        finally:
            self.saving = None
            self.note_progress()

    def save_taken(self) -> None:
        """A save's state was taken here, in the main thread: the step its stall names."""
        self.validating = False
        self.saving_position = self.position()

    def note_progress(self) -> None:
        """This rank moved: a batch, a compile, a save's bytes."""
        self.moved_at = time.monotonic()
        self.anyone_moved_at = self.moved_at
        self.moved_since_beat = True

    def watch(self) -> None:
        beat = min(2.0, self.timeout / 10)  # a store round trip this often at most
        while not self.closed:
            self.woken.wait(beat)
            # A C call that holds the GIL stops this thread too: faulthandler's thread then ends it.
            backstop = self.timeout + 2 * GRACE.total_seconds()
            faulthandler.dump_traceback_later(backstop, exit=True)
            # Closed meanwhile (close() sets closed, then cancels): not armed after the run.
            if self.closed:
                faulthandler.cancel_dump_traceback_later()
                return
            try:
                alarm = self.check()
                if alarm and not self.closed:
                    self.end()
            except (RuntimeError, OSError):
                # The store's host has ended (the run's end): nothing left to watch.
                faulthandler.cancel_dump_traceback_later()
                return

    def check(self) -> bool:
        """One beat: note this rank's progress, share it, and say whether the run has stalled."""
        if is_compiling():
            self.note_progress()
        if self.saving is not None:
            size = bytes_in(self.growing)
            if size != self.saved_bytes:
                self.saved_bytes = size
                self.note_progress()
        now = time.monotonic()
        if self.epoch_step is None and self.saving is None:
            stalled = self.waited_before_training(now) >= self.timeout
        else:
            stalled = now - self.anyone_moved_at >= self.timeout
        # Once more after the first step: a rank still before it counts this one's collectives.
        if self.epoch_step is not None and not self.counted_after_first_step:
            self.count_collectives()
            self.counted_after_first_step = True
        if self.store is None or stalled:
            return stalled
        # A beat of every rank that moved: any rank's move is everyone's.
        beats = self.store.add("beats", int(self.moved_since_beat))
        self.moved_since_beat = False
        if beats != self.beats:
            self.beats = beats
            self.anyone_moved_at = time.monotonic()
        return self.store.check(["alarm"])

    def waited_before_training(self, now: float) -> float:
        """Seconds this rank has waited in a collective that another rank has not started."""
        started = self.count_collectives()
        if started is None:
            return 0.0
        waiting = started > 0 and self.store.add(f"started/{started}", 0) < self.world_size
        if not waiting:
            self.waiting_since = None
            return 0.0
        if self.waiting_since is None:
            self.waiting_since = now
        return now - self.waiting_since

    def count_collectives(self) -> int | None:
        """The collectives this rank has started; each counted in the store, where collective k
        holds how many ranks have started it: a rank at k waits while k's count is short."""
        started = collectives_started()
        if self.store is None or started is None:
            return None
        for k in range(self.counted + 1, started + 1):
            self.store.add(f"started/{k}", 1)
        self.counted = max(self.counted, started)
        return started

    def end(self) -> None:
        """Write this rank's report and stacks, read every rank's, say the line, end the process."""
        self.ending = True
        try:
            # Whatever fails here, the process ends: its main thread waits in close() for this one.
            # The alarm goes first: the others see it at their next beat, while this rank writes
            # its stacks.
            if self.store is not None:
                with contextlib.suppress(RuntimeError):
                    self.store.add("alarm", 1)
            frames = self.write_stacks()
            report = {
                "rank": self.rank,
                "seconds": round(time.monotonic() - self.moved_at),
                "collectives": collectives_started(),
                "position": self.saving_position if self.saving is not None else self.position(),
                "where": where(frames),
                "saving": str(self.saving) if self.saving is not None else None,
            }
            reports = [report]
            if self.store is not None:
                try:
                    reports = self.exchange_reports(report)
                except RuntimeError as e:
                    self.note(f"the other ranks' reports could not be read: {first_line(e)}")
            line = stall_line(reports, self.world_size, self.timeout, self.stacks_dir)
            # once a node, as run_main says an error; each rank's in torchrun's summary
            if first_to_say(line):
                self.say(line)
            record_for_torchrun(line)
            # The store's host (rank 0, for tcp://) ends once every rank has read.
            if self.store is not None:
                with contextlib.suppress(RuntimeError):
                    self.store.add("read", 1)
                    wait_until(lambda: self.store.add("read", 0) >= self.world_size, 30)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    def exchange_reports(self, report: dict) -> list[dict]:
        """Every rank's report that arrives within a few seconds (the others see the alarm in a
        beat)."""
        self.store.set(f"report/{self.rank}", json.dumps(report))
        keys = [f"report/{rank}" for rank in range(self.world_size)]
        started = time.monotonic()
        wait_until(lambda: self.store.check(keys), 10)
        reports = [json.loads(self.store.get(key)) for key in keys if self.store.check([key])]
        if len(reports) < self.world_size:
            waited = time.monotonic() - started
            self.note(f"{len(reports)} of {self.world_size} reports after {waited:.1f} s")
        return reports

    def note(self, line: str) -> None:
        """A line at the end of this rank's stacks file: why its stall line may lack a rank."""
        with contextlib.suppress(OSError):
            with open(self.stacks_dir / f"rank{self.rank}.txt", "a") as file:
                file.write(f"watchdog: {line}\n")

    def position(self) -> str:
        if self.epoch_step is None:
            return "before training"
        epoch, step = self.epoch_step
        if self.validating:
            return f"in validation after step {step} of epoch {epoch + 1}"
        return f"at step {step} of epoch {epoch + 1}"

    def write_stacks(self) -> list[traceback.FrameSummary]:
        """Every thread's and DataLoader worker's stack to stalls/rankR.txt; the frames to name."""
        named = self.saving_thread if self.saving is not None else self.main_thread
        main_frame = sys._current_frames().get(named)
        frames = traceback.extract_stack(main_frame) if main_frame else []
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        lines = []
        # The main thread first; not this thread, which only writes them.
        threads = sorted(
            sys._current_frames().items(), key=lambda item: item[0] != self.main_thread
        )
        for ident, frame in threads:
            if ident != threading.get_ident():
                lines.append(f"rank {self.rank}, thread {names.get(ident, ident)}:\n")
                lines.extend(traceback.format_stack(frame))
                lines.append("\n")
        # Waiting for a DataLoader worker: the worker's line is the one to name.
        if any(frame.name == DATALOADER_WAIT for frame in frames):
            for pid, worker_frames, text in self.worker_stacks():
                lines.append(f"rank {self.rank}, DataLoader worker (pid {pid}):\n{text}\n")
                if user_frame(worker_frames):
                    frames = worker_frames
        # A full or read-only disk, or a missing trace dump: the line still comes.
        with contextlib.suppress(OSError):
            self.stacks_dir.mkdir(parents=True, exist_ok=True)
            (self.stacks_dir / f"rank{self.rank}.txt").write_text("".join(lines))
            if dist.is_initialized() and "nccl" in str(dist.get_backend()):
                # NCCL's Flight Recorder: for python -m torch.distributed.flight_recorder.
                trace = nccl_trace()
                if trace is not None:
                    (self.stacks_dir / f"nccl_trace_rank_{self.rank}").write_bytes(trace)
        return frames

    def close(self) -> None:
        """main() has ended: a watchdog that is ending the run finishes it, else it stops (an
        error on this rank waits here for the stall's line, which it may follow from)."""
        self.closed = True
        self.woken.set()
        faulthandler.cancel_dump_traceback_later()
        while self.ending:
            time.sleep(1)
        # Joined here, not left running into the interpreter's exit: a daemon thread inside a
        # store call then is ended mid-C++, and the process aborts ("terminate called without an
        # active exception").
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=10)


def is_compiling() -> bool:
    """Is any thread compiling? A backward on a GPU, compiled on first use, runs in autograd's
    thread."""
    for top in sys._current_frames().values():
        for frame, _ in traceback.walk_stack(top):
            if COMPILE_FILES.search(frame.f_code.co_filename):
                return True
    return False


def bytes_in(path: Path) -> int:
    """The size of a file, or of every file in a folder; 0 for one not there yet."""
    if path.is_dir():
        sizes = []
        for file in path.rglob("*"):
            with contextlib.suppress(OSError):
                sizes.append(file.stat().st_size)
        return sum(sizes)
    try:
        return path.stat().st_size
    except OSError:
        return 0


def where(frames: list[traceback.FrameSummary]) -> str:
    """'in collate (distributed.py:66)': the user's frame, else the innermost."""
    frame = user_frame(frames)
    if frame is None and frames:
        frame = frames[-1]
    if frame is None:
        return "where unknown"
    worker = ""
    if WORKER_LOOP in {f.name for f in frames}:
        worker = " in a DataLoader worker"
    return f"in {frame.name} ({Path(frame.filename).name}:{frame.lineno}){worker}"


def stall_line(reports: list[dict], world_size: int, timeout: float, stacks_dir: Path) -> str:
    """The one line every rank ends with: the ranks that stalled (that started fewest collectives,
    or did not answer), what each did, and where the stacks are."""
    answered = {report["rank"] for report in reports}
    counts = {report["collectives"] for report in reports}
    if None in counts:
        # PyTorch no longer says how many collectives a rank started: every rank's position.
        parts = [describe(report, timeout) for report in reports]
        head = "the stalled rank is unknown (PyTorch's collective counts are missing): "
        return f"error: {head}{'; '.join(parts)}; every rank's stacks in {stacks_dir}/"
    # A rank that did not answer is the one; else those behind the others; else (all in one
    # place) every rank.
    fewest = min(counts)
    stalled = []
    for report in reports:
        if report["collectives"] == fewest and (len(counts) > 1 or len(answered) == world_size):
            stalled.append(report)
    parts = [describe(report, timeout) for report in stalled]
    for rank in range(world_size):
        if rank not in answered:
            parts.append(
                f"rank {rank} did not answer (its main thread holds the GIL? "
                "it ends with its stacks on stderr)"
            )
    if len(parts) < world_size:
        them = "it" if len(parts) == 1 else "them"
        parts.append(f"the other ranks waited for {them} in a collective")
    return f"error: {'; '.join(parts)}; every rank's stacks in {stacks_dir}/"


def describe(report: dict, timeout: float) -> str:
    seconds = max(report["seconds"], round(timeout))
    if report.get("saving"):
        what = f"wrote nothing to {report['saving']} for {seconds} s"
    else:
        what = f"made no progress for {seconds} s"
    return f"rank {report['rank']} {what} {report['position']}, {report['where']}"


# ---- PyTorch's private names the watchdog reaches (tests/test_internals.py checks each) ----

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


def wait_until(condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
