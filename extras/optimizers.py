"""The optimizer (--optimizer), the learning-rate schedule (a linear warm-up into a cosine decay,
per optimizer step) and the moving average of the weights (--ema).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.nn as nn

from utils import Wrapped, local_shard, unwrap


def build_optimizer(model: nn.Module, args) -> torch.optim.Optimizer | Each:
    """--optimizer over the model's parameters, with its peak lr and weight decay (check_args
    fills their defaults); models trained together (a GAN): one each, run.optimizer["generator"].
    """
    if isinstance(model, Wrapped):
        return Each({name: build_optimizer(part, args) for name, part in model.items()})
    params = model.parameters()
    # AdamW fused: each tensor in one pass, where foreach (the default) makes a temporary copy of
    # all the weights; not with float16 (FSDP's gradient scaler checks overflow on all ranks on the
    # foreach path only), nor for SGD (FSDP's shards have no fused SGD; and where float16's scaler
    # skips a step, fused SGD still moves its momentum: weights NaN on an H200, PyTorch 2.11).
    if args.optimizer == "adamw":
        fused = None
        if getattr(args, "amp_dtype", None) != "float16":
            fused = True
        return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, fused=fused)
    return torch.optim.SGD(
        params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay
    )


class Each(dict):
    """The optimizers (or schedulers) of models trained together, by the model's name: saved,
    restored, stepped and timed together; param_groups and state are all of theirs."""

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


class WarmupCosine:
    """The lr factor at a step: a linear rise over the first `warmup` part of `steps`, then a
    cosine decay to 0."""

    def __init__(self, steps: int, warmup: float):
        self.steps = steps
        self.rise = max(1, round(warmup * steps))

    def __call__(self, step: int) -> float:
        if step < self.rise:
            return (step + 1) / self.rise
        decayed = (step - self.rise) / max(1, self.steps - self.rise)
        return 0.5 * (1 + math.cos(math.pi * decayed))


def warmup_cosine(
    optimizer: torch.optim.Optimizer | Each, steps: int, warmup: float
) -> torch.optim.lr_scheduler.LambdaLR | Each:
    """The learning-rate schedule, stepped per step (models trained together: one for each
    optimizer, run.scheduler["generator"])."""
    if isinstance(optimizer, Each):
        return Each({name: warmup_cosine(part, steps, warmup) for name, part in optimizer.items()})
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(steps, warmup))


class EMA:
    """--ema DECAY: a moving average of the weights and buffers, updated after each optimizer step
    on every rank (under FSDP each its own shards), validated and saved beside them. Its decay is
    min(DECAY, (1 + n) / (10 + n)) at update n (TensorFlow's num_updates): the first weights fade
    fast. Without --ema it does nothing.
    """

    def __init__(self, model: nn.Module, decay: float | None):
        self.model = unwrap(model)
        self.decay = decay
        self.updates = 0
        self.average = {}
        self.lists = None
        if decay is not None:
            self.average = {name: t.detach().clone() for name, t in self.named().items()}

    def named(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers by plain name (no DDP "module."), each once (a tied head is
        one)."""
        return dict([*self.model.named_parameters(), *self.model.named_buffers()])

    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(average, weight): this rank's part of each."""
        named = self.named()
        return [
            (local_shard(average), local_shard(named[name]).detach())
            for name, average in self.average.items()
        ]

    def update(self) -> None:
        if self.average:  # without --ema, nothing
            self.move()

    @torch.no_grad()
    def move(self) -> None:
        """The average moves toward the weights."""
        self.updates += 1
        weight = 1 - min(self.decay, (1 + self.updates) / (10 + self.updates))
        if self.lists is None:  # listed once (a checkpoint's load lists them anew)
            pairs = self.pairs()
            floats = [pair for pair in pairs if pair[0].is_floating_point()]
            integers = [pair for pair in pairs if not pair[0].is_floating_point()]
            self.lists = (
                [average for average, _ in floats],
                [live for _, live in floats],
                [average for average, _ in integers],
                [live for _, live in integers],
            )
        averages, lives, integer_averages, integer_lives = self.lists
        # One call for all the weights; integers (batch norm's count) copied as they are.
        torch._foreach_lerp_(averages, lives, weight)
        if integer_averages:
            torch._foreach_copy_(integer_averages, integer_lives)

    @contextlib.contextmanager
    def swapped(self):
        """The model holds the average within, then its own weights again, bit for bit."""
        self.swap()
        yield  # an error in it ends the run: no step is ever taken on the average
        self.swap()

    def swapped_for(self, name: str | None):
        """The average within, for a validation value of the average's (a name ending in _ema);
        else the weights as they are."""
        if name is not None and name.endswith("_ema"):
            return self.swapped()
        return contextlib.nullcontext()

    @torch.no_grad()
    def swap(self) -> None:
        # A tensor at a time: no second copy of the model.
        for average, live in self.pairs():
            kept = live.clone()
            live.copy_(average)
            average.copy_(kept)

    def evaluated(self, evaluate: Callable[..., dict], *args) -> dict:
        """evaluate(*args)'s record; with --ema the average's too."""
        record = evaluate(*args)
        if self.average:
            with self.swapped():
                for key, value in evaluate(*args).items():
                    if key != "val_images":
                        record[f"{key}_ema"] = value
        return record

    def state_dict(self) -> dict:
        return {"updates": self.updates, "average": self.average}

    def load_state_dict(self, state: dict) -> None:
        if state["average"].keys() != self.average.keys():
            raise ValueError("its --ema is not this run's")
        # A sharded checkpoint has loaded into the average itself; checkpoint.pt's tensors go to
        # its device.
        self.updates = state["updates"]
        self.lists = None
        for name, tensor in state["average"].items():
            self.average[name] = tensor.to(self.average[name].device)
