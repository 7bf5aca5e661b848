"""--profile A:B: torch.profiler over optimizer steps A to B of a run, one Chrome trace per rank
(OUTPUT_DIR/profile/rank{r}.json), the step's phases marked in it as ranges: data, forward, loss +
backward, optimizer. Off, it registers nothing and costs nothing.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from torch import nn
from torch.autograd.profiler import record_function
from torch.profiler import profile

from .errors import UsageError

log = logging.getLogger("train")


def steps_to_profile(spec: str | None) -> tuple[int, int] | None:
    """--profile A:B as (A, B), optimizer steps of this run counted from 1; None without it."""
    if not spec:
        return None
    first, _, last = spec.partition(":")
    if not (first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
        raise UsageError(f"--profile {spec}: give the first and last step as A:B, 1 <= A <= B")
    return int(first), int(last)


class StepProfiler(contextlib.AbstractContextManager):
    """With --profile A:B, the model's forward hooks and the optimizer's step hooks (all on the
    main thread) mark each phase and start the profiler before step A's data, stop it after step
    B's optimizer step and write this rank's trace. A context: a run that ends sooner writes what
    it has."""

    def __init__(self, spec, model: nn.Module, optimizer, output_dir: Path, rank: int):
        self.steps = steps_to_profile(spec)
        self.path = output_dir / "profile" / f"rank{rank}.json"
        self.profiler = None
        self.done = 0
        if self.steps is None:
            return
        model.register_forward_pre_hook(lambda module, inputs: self.enter("forward", module))
        model.register_forward_hook(lambda module, *_: self.enter("loss + backward", module))
        optimizer.register_step_pre_hook(lambda *_: self.enter("optimizer"))
        optimizer.register_step_post_hook(lambda *_: self.stepped())
        if self.steps[0] == 1:
            self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """The profile begins (CPU, and CUDA where there is a GPU), with the next step's data."""
        self.profiler = profile().__enter__()
        self.phase = record_function("data").__enter__()

    def enter(self, phase: str, module: nn.Module | None = None) -> None:
        """While profiling, phase's range begins and the one before it ends (a training
        forward's only)."""
        if self.profiler is None or (module is not None and not module.training):
            return
        self.phase.__exit__(None, None, None)
        self.phase = record_function(phase).__enter__()

    def stepped(self) -> None:
        """After an optimizer step: the next step's data begins, or the profile starts or ends."""
        self.done += 1
        if self.done == self.steps[0] - 1:
            self.start()
        elif self.done == self.steps[1]:
            self.stop()
        else:
            self.enter("data")

    def stop(self) -> None:
        """The profile ends, written as this rank's trace."""
        if self.profiler is None:
            return
        self.phase.__exit__(None, None, None)
        self.profiler.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(self.path))
        self.profiler = None
        log.info(
            f"profile of steps {self.steps[0]}-{self.steps[1]}: {self.path.parent}/rank*.json, one"
            " a rank (open in https://ui.perfetto.dev, or with Holistic Trace Analysis)"
        )
