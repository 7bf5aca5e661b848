"""--ema DECAY: a moving average of the weights, validated and saved beside them.

A script makes it in one block, and asks `if run.ema is not None` where it updates, validates and
saves it:

    ema = None
    if args.ema is not None:  # 0 too: the weights themselves, validated twice
        from extras import averages

        ema = averages.EMA(model, args.ema)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn as nn

from utils import local_shard, unwrap


class EMA:
    """--ema DECAY: a moving average of the weights and buffers, updated after each optimizer step
    on every rank (under FSDP each its own shards), validated and saved beside them. Its decay is
    min(DECAY, (1 + n) / (10 + n)) at update n (TensorFlow's num_updates): the first weights fade
    fast.
    """

    def __init__(self, model: nn.Module, decay: float):
        self.model = unwrap(model)
        self.decay = decay
        self.updates = 0
        self.lists = None
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

    @torch.no_grad()
    def update(self) -> None:
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

    @torch.no_grad()
    def swap(self) -> None:
        # A tensor at a time: no second copy of the model.
        for average, live in self.pairs():
            kept = live.clone()
            live.copy_(average)
            average.copy_(kept)

    def evaluated(self, evaluate: Callable[..., dict], *args) -> dict:
        """evaluate(*args)'s record, and the average's beside it (val_loss_ema, ...)."""
        record = evaluate(*args)
        with self.swapped():
            for key, value in evaluate(*args).items():
                if key != "val_images":
                    record[f"{key}_ema"] = value
        return record

    def state_dict(self) -> dict:
        return {"updates": self.updates, "average": self.average}

    def load_state_dict(self, state: dict | None) -> None:
        # None: a checkpoint written without --ema
        if state is None or state["average"].keys() != self.average.keys():
            raise ValueError("its --ema is not this run's")
        # A sharded checkpoint has loaded into the average itself; checkpoint.pt's tensors go to
        # its device.
        self.updates = state["updates"]
        self.lists = None
        for name, tensor in state["average"].items():
            self.average[name] = tensor.to(self.average[name].device)
