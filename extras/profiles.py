"""Where a step's time goes, on each rank. Its phases (StepPhases), timed every step, gathered
from all ranks at each record (in the record's own all-reduce) and read as milliseconds a step; a
rank whose own work is slower than the others', on average and in its median step, is named with
its phase. A CPU's phases are timed
by the host's clock, a GPU's by CUDA events read back only at a record, so a step that records
nothing waits for nothing. And --profile A:B: torch.profiler over optimizer steps A to B of a run,
one Chrome trace per rank (OUTPUT_DIR/profile/rank{r}.json), the phases in it as ranges of the
same names; off, it watches nothing and costs nothing.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from pathlib import Path

import torch
from torch import nn
from torch.autograd import Variable
from torch.autograd.profiler import record_function
from torch.profiler import profile

from utils import UsageError, tree_flatten

log = logging.getLogger("train")

# A step's phases, in order: waiting for the batch; the forward and the loss, up to the first
# gradient at the model's outputs; the backward, up to its last gradient (DDP's last bucket
# handed to its all-reduce); the wait for the other ranks' gradients (and the agreement on
# stopping); the optimizer's step and what follows it (the moving average, the schedule, the
# records). DiLoCo adds its outer step, every H steps.
PHASES = ("data", "forward + loss", "backward", "wait", "optimizer", "outer")
DATA, FORWARD, BACKWARD, WAIT, OPTIMIZER, OUTER = range(len(PHASES))
# A rank is slow in a phase of its own work where its time there exceeds the other ranks' median
# by over a fifth of a step and 5 ms, over at least 16 steps, both on average and in its typical
# (median) step: each step, every rank waits for its excess. Even runs stay below it: two ranks'
# phases differed by up to 17% of a step on a loaded 2-core host (docs/speed.md), and a tiny
# model's steps of a few ms on a machine doing other work by 2.7 ms and, in CI, by 5.7 ms on
# average (a scheduler's hiccups, named as a slow backward when a hiccup in a few steps counted as
# a rank slow in all); a record of fewer steps is too short to tell.
SLOW_SHARE = 0.2
MARGIN_MS = 5.0
MIN_STEPS = 16


class StepPhases:
    """This rank's time in each phase, since the last record and in this epoch: Meter.timed
    marks the data, hooks the rest (watch); one phase runs at a time, so a record's phases add
    up to its steps' time. A step is counted at its first optimizer step after its data, however
    many forwards and optimizer steps it takes (a GAN's two)."""

    def __init__(self, device: torch.device, outer: bool = False):
        self.names = PHASES[: OUTER + outer]
        self.gpu = device.type == "cuda"
        self.seconds = [0.0] * len(self.names)
        self.step = [0.0] * len(self.names)  # the step under way's
        self.steps = 0
        self.counted = False  # whether the step under way has been counted
        self.step_watchers = []  # told as each step begins: --profile's count
        self.step_rows = []  # each step's seconds a phase, since the last read
        self.epoch = torch.zeros(len(self.names) + 1, dtype=torch.float64)  # seconds, steps
        self.epoch_steps = []  # the epoch's records' step rows (tensors)
        self.phase = None  # none between epochs
        self.since = None  # when it began: a clock's reading, or a CUDA event
        self.pending = []  # on a GPU: (phase, start, end event, a step ends) not yet read
        self.free = []  # CUDA events read, to record again
        self.watchers = []  # --profile's ranges
        self.own = (DATA, FORWARD, BACKWARD, OPTIMIZER)  # a rank's own work

    def watch(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """The model's forward hook marks the backward's start, the optimizer's step hook its
        phase (models trained together: each one's, each optimizer's)."""
        # models trained together (together.Wrapped): each one's
        for part in model.values() if getattr(model, "trained_together", False) else [model]:
            # a forward begins its phase (an accumulated step's later micro-batches, read before)
            part.register_forward_pre_hook(lambda module, inputs: self.enter(FORWARD, module))
            part.register_forward_hook(self.forward_ends)
        optimizer.register_step_pre_hook(lambda *_: self.enter(OPTIMIZER))
        # FSDP's forward and backward hold its collectives: waits for the others
        if hasattr(getattr(model, "_orig_mod", model), "unshard"):
            self.own = (DATA, OPTIMIZER)

    def new_step(self) -> None:
        """The loop's next step begins: its first optimizer step counts it (a GAN's second does
        not)."""
        self.counted = False
        for watcher in self.step_watchers:
            watcher()

    def forward_ends(self, module: nn.Module, inputs, outputs) -> None:
        """A training forward's end: the first gradient at its outputs begins the backward."""
        if not (module.training and torch.is_grad_enabled()):
            return
        for tensor in tree_flatten(outputs)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(self.backward_begins)
                return

    def backward_begins(self, grad: torch.Tensor) -> None:
        self.enter(BACKWARD)
        # Run by autograd once the backward has made every gradient (DDP: its last bucket handed
        # to its all-reduce), before DDP's own final callback waits for the all-reduces; FSDP2
        # marks its backward's end the same way.
        Variable._execution_engine.queue_callback(self.backward_ends)

    def backward_ends(self) -> None:
        self.enter(WAIT)

    def begin(self) -> None:
        """An epoch's steps begin, with the first batch's data."""
        self.phase = DATA
        self.since = self.now()
        self.tell(DATA)

    def now(self):
        """The host's clock; on a GPU an event recorded on the current stream (one read before,
        where there is one)."""
        if not self.gpu:
            return time.perf_counter()
        if self.free:
            event = self.free.pop()
        else:
            event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def enter(self, phase: int | str, module: nn.Module | None = None) -> None:
        """phase (or its name: "optimizer") begins and the one before it ends, its time kept
        (between epochs, or in an evaluation's forward, nothing)."""
        if isinstance(phase, str):
            phase = PHASES.index(phase)
        if self.phase in (None, phase) or (module is not None and not module.training):
            return
        now = self.now()
        # a step's first optimizer step ends its row (and begins the next one's)
        step_ends = phase == OPTIMIZER and not self.counted
        if self.gpu:
            self.pending.append((self.phase, self.since, now, step_ends))
        else:
            self.add(self.phase, now - self.since, step_ends)
        if step_ends:
            self.steps += 1
        self.counted = phase != DATA and (self.counted or step_ends)
        self.phase, self.since = phase, now
        self.tell(phase)

    def batch_arrived(self) -> None:
        """The step's batch is here (metrics.Meter.timed): its forward begins."""
        self.enter(FORWARD)

    def batch_asked(self) -> None:
        """The next batch is asked for (metrics.Meter.timed)."""
        self.enter(DATA)

    def tell(self, phase: int | None) -> None:
        for watcher in self.watchers:
            watcher(phase)

    def pause(self) -> None:
        """The epoch's steps end: its last phase too."""
        self.enter(DATA)
        self.phase = None
        self.tell(None)

    def add(self, phase: int, seconds: float, step_ends: bool) -> None:
        self.seconds[phase] += seconds
        self.step[phase] += seconds
        if step_ends:
            self.step_rows.append(self.step)
            self.step = [0.0] * len(self.names)

    def read(self) -> torch.Tensor:
        """Seconds in each phase since the last read, a median step's, and the steps (float64,
        on the CPU). On a GPU it waits for the events (a sync: at a record only)."""
        if self.pending:
            self.pending[-1][2].synchronize()
        for phase, start, end, step_ends in self.pending:
            self.add(phase, start.elapsed_time(end) / 1000, step_ends)
            self.free.append(start)
        self.pending = []
        rows = torch.tensor(self.step_rows, dtype=torch.float64).view(-1, len(self.names))
        sums = torch.tensor([*self.seconds, self.steps], dtype=torch.float64)
        self.seconds = [0.0] * len(self.names)
        self.steps = 0
        self.step_rows = []
        self.epoch += sums
        self.epoch_steps.append(rows)
        return self.row(sums, rows)

    def epoch_read(self) -> torch.Tensor:
        """read() over the whole epoch, which starts again."""
        self.read()
        row = self.row(self.epoch, torch.cat(self.epoch_steps))
        self.epoch = torch.zeros_like(self.epoch)
        self.epoch_steps = []
        return row

    def row(self, sums: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Seconds in each phase, a median step's (of rows, a step's each), and the steps: a row
        of the records' table."""
        median = torch.zeros(len(self.names), dtype=torch.float64)
        if len(rows):
            median = rows.quantile(0.5, dim=0)
        return torch.cat([sums[:-1], median, sums[-1:]])

    def summary(self, table: torch.Tensor) -> dict:
        """All ranks' rows (read's) as ms a step per phase, and the slow rank: where a phase of its
        own work exceeds the other ranks' median by over SLOW_SHARE of a step and MARGIN_MS, over
        MIN_STEPS steps or more, on average and in a median step."""
        n = len(self.names)
        steps = table[:, -1].clamp(min=1)
        ms = (table[:, :n] * 1000 / steps[:, None]).tolist()
        typical = (table[:, n : 2 * n] * 1000).tolist()
        phase_ms = {name: [round(row[i], 3) for row in ms] for i, name in enumerate(self.names)}
        margin = max(MARGIN_MS, SLOW_SHARE * statistics.median(map(sum, ms)))
        slow, worst = None, 0.0
        # a world of one: no other rank to compare with; a few steps: too few to tell
        if len(ms) < 2 or steps.min() < MIN_STEPS:
            return dict(phase_ms=phase_ms, slow=slow)
        for i in self.own:
            times = phase_ms[self.names[i]]
            medians = [row[i] for row in typical]
            for rank, time_ms in enumerate(times):
                others = statistics.median(times[:rank] + times[rank + 1 :])
                # a hiccup in a few steps is no slow rank: its median step is slower too
                in_most = medians[rank] - statistics.median(medians[:rank] + medians[rank + 1 :])
                if time_ms - others > max(margin, worst) and in_most > margin:
                    worst = time_ms - others
                    slow = dict(rank=rank, phase=self.names[i], ms=time_ms, median_ms=others)
        return dict(phase_ms=phase_ms, slow=slow)


class StepProfiler(contextlib.AbstractContextManager):
    """With --profile A:B, the step's phases (StepPhases) as ranges of the same names: the profiler
    starts before step A's data and stops after step B's optimizer step, writing this rank's
    trace. A context: a run that ends sooner writes what it has."""

    def __init__(self, spec, phases: StepPhases, output_dir: Path, rank: int):
        self.steps = steps_to_profile(spec)
        self.path = output_dir / "profile" / f"rank{rank}.json"
        self.profiler = self.phase = None
        self.done = 0  # steps begun: a step's first optimizer step (a GAN's are two)
        self.counted = False  # whether the step under way has been counted
        self.started = False
        if self.steps is not None:
            phases.watchers.append(self.enter)
            phases.step_watchers.append(self.new_step)

    def __exit__(self, *exc) -> None:
        self.stop()
        # a run that ended well before step A: said, not a trace silently missing
        if exc[0] is None and self.steps is not None and not self.started:
            first, last = self.steps
            log.info(
                f"--profile {first}:{last}: no trace written: this run ended after {self.done}"
                f" optimizer steps, before step {first}"
            )

    def new_step(self) -> None:
        self.counted = False

    def enter(self, phase: int | None) -> None:
        """A phase begins (None: the epoch's steps ended): the profile starts with step A's data,
        ends with step B + 1's, and the range before it ends."""
        if phase == OPTIMIZER and not self.counted:
            self.done += 1
        self.counted = phase not in (DATA, None) and (self.counted or phase == OPTIMIZER)
        if phase in (DATA, None) and self.done == self.steps[1]:
            self.stop()
        if self.phase is not None:
            self.phase.__exit__(None, None, None)
            self.phase = None
        if phase == DATA and self.done == self.steps[0] - 1 and not self.started:
            # CPU, and CUDA where there is a GPU
            self.profiler = profile().__enter__()
            self.started = True
        if self.profiler is not None and phase is not None:
            self.phase = record_function(PHASES[phase]).__enter__()

    def stop(self) -> None:
        """The profile ends, written as this rank's trace."""
        if self.profiler is None:
            return
        if self.phase is not None:
            self.phase.__exit__(None, None, None)
            self.phase = None
        self.profiler.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(self.path))
        self.profiler = None
        log.info(
            f"profile of steps {self.steps[0]}-{self.steps[1]}: {self.path.parent}/rank*.json, one"
            " a rank (open in https://ui.perfetto.dev, or with Holistic Trace Analysis)"
        )


def steps_to_profile(spec: str | None) -> tuple[int, int] | None:
    """--profile A:B as (A, B), optimizer steps of this run counted from 1; None without it."""
    if not spec:
        return None
    first, _, last = spec.partition(":")
    if not (first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
        raise UsageError(f"--profile {spec}: give the first and last step as A:B, 1 <= A <= B")
    return int(first), int(last)
