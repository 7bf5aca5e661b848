"""Models trained together, by name (a GAN's generator and discriminator): build_model returns
a TrainedTogether, and each model gets its own DDP (Wrapped), optimizer and schedule. A script
imports this where its model is one."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn


class TrainedTogether(nn.ModuleDict):
    """Models trained together, by name (a GAN's generator and discriminator), as build_model
    returns them: each in its own DDP, with its own optimizer and schedule, run.model["generator"];
    its forward (a subclass's) is what validation and the start-up check call."""


class Wrapped(nn.ModuleDict):
    """Models trained together (TrainedTogether), each in its own wrapper, wrap(part, **options)
    (its own DDP): run.model["generator"]. Its module, which unwrap() gives, is the ModuleDict as
    built: what validation calls, what the checkpoints save."""

    def __init__(self, models: nn.ModuleDict, wrap: Callable[..., nn.Module], **options):
        super().__init__({name: wrap(part, **options) for name, part in models.items()})
        self.__dict__["module"] = models  # not a submodule: its weights are the parts' own

    def register_comm_hook(self, state, hook: Callable) -> None:
        for part in self.values():
            part.register_comm_hook(state, hook)

    def train(self, mode: bool = True) -> Wrapped:
        self.module.train(mode)  # the ModuleDict as built too, whose forward validation calls
        return super().train(mode)


def each(model: nn.Module, wrap: Callable[..., nn.Module], **options) -> nn.Module:
    """wrap(model, **options); models trained together (Wrapped): each part so, in its place."""
    if not isinstance(model, Wrapped):
        return wrap(model, **options)
    for name, part in list(model.items()):
        model[name] = wrap(part, **options)
    return model
