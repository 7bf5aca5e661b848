"""The step every rank stops after: a signal (SIGTERM, SIGUSR1) on any rank, a stream that ended on
one, or a batch one rank could not read; and the steps every rank saves after, every so many
minutes; a checkpoint that failed to be written in the background ends every rank. One small
all-reduce a step, started as the step begins and awaited after it (loops.EpochSteps.done).
"""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

from .errors import UsageError
from .ranks import all_gather_objects, cpu_group, errors_shared_by_all_ranks, world_size


class StopSignal:
    """Notes SIGTERM and SIGUSR1 (preemption, Slurm's --signal) instead of dying at once; all ranks
    agree on the step to stop after, and, given save_minutes, on a step to save after each time
    that many minutes have passed on any rank's clock."""

    def __init__(self, save_minutes: float | None = None):
        self.signal = 0
        self.work = None
        # The step's flags (signal, lacking a batch, save timer, a failed write), all-reduced in
        # place to what every rank agreed on: one tensor, made once, each step's numbers written
        # and read through its NumPy view (a torch.tensor of a list each step cost about 25 us of
        # the step's CPU time).
        self.flags = torch.zeros(4, dtype=torch.long)
        self.saves = None
        self.values = self.flags.numpy()
        self.save_seconds = (save_minutes or 0) * 60
        self.saved_at = time.monotonic()
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(signum, self.note)
        # A world of one agrees with itself: no collective.
        self.alone = world_size() == 1
        # With GPUs the flags go over the CPU: no GPU synchronisation every step.
        self.group = None if self.alone else cpu_group()

    def watch(self, saves) -> None:
        """A checkpoint write that failed in the background (checkpoints.Saves: rank 0's files,
        FSDP's shards on every rank) ends every rank with its line at the next step."""
        self.saves = saves

    def note(self, signum: int, frame) -> None:
        self.signal = signum

    def agreed(self) -> tuple[int, bool]:
        """(the signal of any rank or 0, does some rank lack the next batch), as they were when
        this step began."""
        # Once a step, after it: the all-reduce is done by then.
        if self.work is not None:
            self.work.wait()
            self.work = None
        # A checkpoint being written failed (a full disk): every rank ends with its line.
        if self.values[3]:
            with errors_shared_by_all_ranks():
                self.saves.wait()
        return int(self.values[0]), bool(self.values[1])

    def save_timer_fired(self) -> bool:
        """After agreed(): did the --save-minutes timer fire on some rank as this step began? Then
        every rank saves after it, and the timer starts again."""
        if not self.values[2]:
            return False
        self.saved_at = time.monotonic()
        return True

    def steps(self, batches, first_step: int, steps: int):
        """Every rank iterates it, in the same steps: (step, batch) for steps first_step + 1 to
        steps (1-based), while every rank has a batch. It reads one batch ahead, and as each step
        begins it starts a small all-reduce (any rank's signal, any rank without a next batch) that
        agreed() awaits after the step. A batch one rank cannot read (a bad file) ends
        every rank with its line."""
        batches = iter(batches)
        step = first_step
        batch = ahead = None
        error = ""
        if step < steps:
            ahead, error = next_batch(batches)
        while True:
            # Each step starts the all-reduce that agreed() waits for: 1 where a rank has no next
            # batch, 2 where one could not read it.
            lacking = 2 if error else int(ahead is None)
            due = self.save_seconds > 0 and time.monotonic() - self.saved_at >= self.save_seconds
            # the last step's all-reduce is done: agreed() waited for it
            failed = self.saves is not None and self.saves.failed()
            self.values[:] = [self.signal, lacking, int(due), int(failed)]
            if not self.alone:
                self.work = dist.all_reduce(self.flags, dist.ReduceOp.MAX, self.group, True)
            if step > first_step:
                yield step, batch
            # A stream that ended early, or on one rank sooner: all end the epoch here.
            if self.agreed()[1]:
                break
            step += 1
            batch = ahead
            ahead = None
            if step < steps:
                ahead, error = next_batch(batches)
        if self.values[1] == 2:
            raise UsageError(next(e for e in all_gather_objects(error) if e))
        if step == 0:
            raise UsageError(
                "the training data gave no full batch this epoch: lower --batch-size or use more"
                " data"
            )


def next_batch(batches) -> tuple[object, str]:
    """(the next batch or None at the end, ""), or (None, the line) where the dataset raised a
    UsageError (the built-in image folder's file that cannot be read)."""
    try:
        return next(batches, None), ""
    except UsageError as e:
        return None, str(e)
