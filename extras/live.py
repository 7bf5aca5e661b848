"""A terminal's live line: on rank 0, where standard error is a terminal, one line rewritten in
place about once a second while anything runs. Training: the epoch, the step of steps, the run's
percent, the last record's loss (all ranks') and speed, the time left, the seconds since the last
step; a validation's batch of batches; a checkpoint being written; the start (data and model being
built). The records' lines stand on lines of their own above it. Where standard error is no
terminal (Slurm, a pipe, a file) the script builds none: no "\\r" is written. It reads what the
watchdog (stalls.Watchdog) already notes and the records already hold: nothing from a GPU.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import threading
import time
from pathlib import Path


class LiveLine(contextlib.AbstractContextManager):
    """Rank 0's live line, drawn by a thread of its own from watchdog's notes of progress (the
    step, a validation's batches, a save); show() hands it the records and the validation loader
    once they are built. Log lines clear it first and it is drawn again after them; closed as main
    ends, it is cleared and the terminal holds the log lines alone."""

    def __init__(self, watchdog, epochs: int, stream=sys.stderr, every: float = 1.0):
        self.watchdog, self.epochs, self.stream, self.every = watchdog, epochs, stream, every
        self.recorder = None  # metrics.StepRecords: the steps an epoch, the last record
        self.val_batches = None  # a validation's batches, where its loader knows them
        self.started = time.monotonic()
        self.since = None  # (when, global step) of the first step seen: the speed of steps
        self.loss, self.speed = "", None  # the last training record's loss, and its samples/s
        # where the last log line was printed: (training step, validation batches), which a
        # validation's record ends
        self.printed_at = (None, 0)
        self.drawn = False
        self.lock = threading.RLock()
        # the log's lines on the terminal (rank 0's records) go above the live line, until it
        # closes
        self.handlers = [
            (handler, handler.stream)
            for handler in logging.getLogger().handlers
            if isinstance(handler, logging.StreamHandler)
            and hasattr(handler.stream, "isatty")  # a FileHandler opened later holds None
            and handler.stream.isatty()
        ]
        for handler, stream in self.handlers:
            handler.setStream(Above(stream, self))
        self.closed = threading.Event()
        # a stall's line, which ends the process, on a line of its own: the live line ends first
        self.say = watchdog.say
        watchdog.say = self.end_and_say
        self.thread = threading.Thread(target=self.run, name="live line", daemon=True)
        self.thread.start()

    def show(self, recorder, val_loader) -> None:
        """The records (their steps an epoch, the last one's loss and speed) and the validation's
        batches, once built."""
        self.recorder = recorder
        with contextlib.suppress(TypeError):  # a stream without __len__
            self.val_batches = len(val_loader)

    def run(self) -> None:
        while not self.closed.wait(self.every):
            self.draw()

    def end_and_say(self, line: str):
        """The live line cleared and drawn no more, then line said as the watchdog says it."""
        self.end()
        return self.say(line)

    def end(self) -> None:
        with self.lock:
            self.clear()
            self.closed.set()

    def draw(self) -> None:
        """The line as things stand, in place of the last (none once the watchdog ends the run)."""
        text = self.text()
        with self.lock:
            if self.watchdog.ending:  # its line (this rank's or another's) on a line of its own
                self.clear()
            if self.closed.is_set() or self.watchdog.ending:
                return
            # within the terminal's width: a longer line would wrap, and a carriage return would
            # not reach its start
            columns = 120
            with contextlib.suppress(OSError, ValueError):
                columns = os.get_terminal_size(self.stream.fileno()).columns or columns
            self.stream.write("\r\033[K" + text[: columns - 1])
            self.stream.flush()
            self.drawn = True

    def clear(self) -> None:
        """The live line gone, the cursor at the start of its line."""
        with self.lock:
            if self.drawn:
                self.stream.write("\r\033[K")
                self.stream.flush()
                self.drawn = False

    def text(self) -> str:
        dog, now = self.watchdog, time.monotonic()
        idle = f"{now - dog.moved_at:.0f}s since the last step"
        if dog.saving is not None:
            return f"writing {Path(dog.saving).name} ({dog.saved_bytes / 2**20:.0f} MB so far)"
        if dog.epoch_step is None or self.recorder is None:
            return f"starting: building the data and the model ({now - self.started:.0f} s)"
        printed_step, printed_batches = self.printed_at
        batch = dog.val_batches - (printed_batches if printed_step == dog.epoch_step else 0)
        if dog.validating and batch > 0:
            if self.val_batches:  # of N (--ema: the average's validation begins again at 1)
                batch = f"{(batch - 1) % self.val_batches + 1}/{self.val_batches}"
            return f"validating: batch {batch} ({now - dog.moved_at:.0f}s since the last batch)"
        args, steps = self.recorder.args, self.recorder.steps_per_epoch
        epoch, step = dog.epoch_step
        # accumulation's watchdog counts micro-batches: the optimizer step they are in
        step = -(-step // getattr(args, "accum_steps", 1))
        done, total = epoch * steps + step, self.epochs * steps
        parts = [f"epoch {epoch + 1}/{self.epochs} step {step}/{steps} {100 * done / total:.0f}%"]
        last = self.recorder.last_values
        if "train_loss" in last:  # all ranks', as the last training record has them
            self.speed = last["images_per_s"]
            self.loss = f"loss {last['train_loss']:.4f} {self.speed:.0f} samples/s"
        if self.loss:
            parts.append(self.loss)
        # the time left at the last record's speed, as the records say it; before it, at the steps'
        if self.since is None or done < self.since[1]:
            self.since = (now, done)
        seconds = None
        if self.speed:
            seconds = args.batch_size / self.speed * (total - done)
        elif done > self.since[1]:
            seconds = (now - self.since[0]) / (done - self.since[1]) * (total - done)
        if seconds is not None:
            parts.append(f"left {datetime.timedelta(seconds=int(seconds))}")
        return " | ".join([*parts, idle])

    def __exit__(self, *exc_info) -> None:
        self.end()
        for handler, stream in self.handlers:
            handler.setStream(stream)
        self.thread.join(timeout=5)


class Above:
    """A log handler's stream whose lines go above the live line: the live line cleared before
    each write, drawn again after a line's end."""

    def __init__(self, stream, live: LiveLine):
        self.stream, self.live = stream, live

    def write(self, text: str) -> int:
        dog = self.live.watchdog
        self.live.printed_at = (dog.epoch_step, dog.val_batches)
        with self.live.lock:
            self.live.clear()
            written = self.stream.write(text)
            self.stream.flush()
        if text.endswith("\n"):
            self.live.draw()
        return written

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)
