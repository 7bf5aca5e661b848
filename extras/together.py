"""Models trained together, a GAN's generator and discriminator: build_model returns them by name
as a TrainedTogether (a ModuleDict), and each gets its own DDP, optimizer and schedule
(run.model["generator"], run.optimizer["generator"]), saved, restored and timed together.

A script takes them in one block, where it wraps the model in DDP:

    if getattr(model, "trained_together", False):
        from extras import together

        model = together.Wrapped(model, DDP, **options)

utils.build_optimizer and utils.warmup_cosine then make one for each part (Wrapped.each): each
of the three classes says trained_together = True.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn


class TrainedTogether(nn.ModuleDict):
    """Models trained together, by name (a GAN's generator and discriminator), as build_model
    returns them: each in its own DDP, with its own optimizer and schedule, run.model["generator"];
    its forward (a subclass's) is what validation and the start-up check call."""

    trained_together = True


class Wrapped(nn.ModuleDict):
    """Models trained together (TrainedTogether), each in its own wrapper, wrap(part, **options)
    (its own DDP): run.model["generator"]. Its module, which unwrap() gives, is the ModuleDict as
    built: what validation calls, what the checkpoints save."""

    trained_together = True  # what utils.build_optimizer and the scripts' --compile ask

    def __init__(self, models: nn.ModuleDict, wrap: Callable[..., nn.Module], **options):
        super().__init__({name: wrap(part, **options) for name, part in models.items()})
        self.__dict__["module"] = models  # not a submodule: its weights are the parts' own

    def register_comm_hook(self, state, hook: Callable) -> None:
        for part in self.values():
            part.register_comm_hook(state, hook)

    def train(self, mode: bool = True) -> Wrapped:
        self.module.train(mode)  # the ModuleDict as built too, whose forward validation calls
        return super().train(mode)

    def each(self, build: Callable, *args) -> Each:
        """build(part, *args) for each part, by its name: its optimizer (utils.build_optimizer)."""
        return Each({name: build(part, *args) for name, part in self.items()})

    def compiled(self, **options) -> Wrapped:
        """Each part compiled in its place (torch.compile(part, **options)): DDP's buckets split
        each one's graph."""
        for name, part in list(self.items()):
            self[name] = torch.compile(part, **options)
        return self


class Each(dict):
    """The optimizers (or schedulers) of models trained together, by the model's name: saved,
    restored, stepped and timed together; param_groups and state are all of theirs."""

    trained_together = True  # what utils.warmup_cosine asks

    def each(self, build: Callable, *args) -> Each:
        """build(part, *args) for each, by its name: its schedule (utils.warmup_cosine)."""
        return Each({name: build(part, *args) for name, part in self.items()})

    def state_dict(self) -> dict:
        return {name: part.state_dict() for name, part in self.items()}

    def load_state_dict(self, state: dict) -> None:
        for name, part in self.items():
            part.load_state_dict(state[name])

    def step(self) -> None:
        for part in self.values():
            part.step()

    def register_step_pre_hook(self, hook: Callable) -> None:
        for part in self.values():
            part.register_step_pre_hook(hook)

    @property
    def param_groups(self) -> list[dict]:
        return [group for part in self.values() for group in part.param_groups]

    @property
    def state(self) -> dict:
        return {key: value for part in self.values() for key, value in part.state.items()}
