"""What a project brings beyond data and model (build_sampler, build_metrics, --keep-best), driven as a user drives
the scripts: their own sampler (a WeightedRandomSampler, a length-bucketing batch sampler) trains on any number of
processes what one process does, continued too; their torchmetrics count every validation sample once (checked
against scikit-learn on the saved model); the best validation's weights are kept, and kept across a continuation."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from processes import max_weight_difference, metrics, run, run_parallel
from test_your_own_data import copy_with_your_functions, launch

# A 4-class set whose class 3 is rare (8 %), a sampler that draws it five times as often, without a generator of
# its own (it draws from torch's global stream), and a Dataset that writes which index each rank reads in each
# epoch. SIGTERM_AT_FORWARD: the model sends its own process SIGTERM in that training forward (a preemption).
YOUR_IMBALANCED = '''
import os
import signal

RARE, WEIGHT = 3, 5.0


class Imbalanced(torch.utils.data.Dataset):
    """Float inputs of shape (1, 8, 8) around one centre per class; class 3 is 8 % of the samples."""

    def __init__(self, size: int, seed: int, log: str | None = None):
        generator = torch.Generator().manual_seed(seed)
        centres = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
        self.labels = torch.multinomial(torch.tensor([0.31, 0.31, 0.30, 0.08]), size, True, generator=generator)
        self.inputs = centres[self.labels] + 1.5 * torch.randn(size, 1, 8, 8, generator=generator)
        self.log, self.epoch = log, None

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        if self.log and self.epoch is not None:  # training's reads (not the start-up check's)
            with open(f"{self.log}/draws-{os.environ.get('RANK', '0')}.txt", "a") as f:
                f.write(f"{self.epoch} {index}\\n")
        return self.inputs[index], int(self.labels[index])


class Preempted(nn.Sequential):
    forwards = 0

    def forward(self, x):
        self.forwards += self.training
        if self.forwards == int(os.environ.get("SIGTERM_AT_FORWARD", 0)):
            os.kill(os.getpid(), signal.SIGTERM)
        return super().forward(x)


def build_datasets(args):
    os.makedirs(args.output_dir, exist_ok=True)
    return Imbalanced(640, seed=1, log=args.output_dir), Imbalanced(203, seed=2), 4


def build_model(args, num_classes):
    return Preempted(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, num_classes))


def compute_loss(outputs, targets):
    return F.cross_entropy(outputs, targets)


def build_sampler(args, train_set):
    weights = torch.where(train_set.labels == RARE, WEIGHT, 1.0)
    return torch.utils.data.WeightedRandomSampler(weights, len(weights))
'''
SAMPLED = [
    "--batch-size",
    "64",
    "--epochs",
    "3",
    "--lr",
    "0.05",
    "--workers",
    "0",
    "--timeout",
    "60",
]


def draws(out: Path) -> dict[int, Counter]:
    """The indices all ranks read, as a multiset an epoch."""
    epochs: dict[int, Counter] = {}
    for path in out.glob("draws-*.txt"):
        for line in path.read_text().splitlines():
            epoch, index = map(int, line.split())
            epochs.setdefault(epoch, Counter())[index] += 1
    return epochs


def test_a_weighted_sampler_trains_on_any_number_of_processes_what_one_does_and_continues_exactly(
    tmp_path,
):
    """WeightedRandomSampler, no generator of its own: 1 process x 64, 2 x 32 and 3 x 21-22 draw the same indices each
    epoch and end with the same weights; the rare class is drawn about five times as often; a run stopped by
    SIGTERM in epoch 2 and continued ends as the straight one."""
    copy = copy_with_your_functions("distributed.py", tmp_path / "copy", YOUR_IMBALANCED)
    outs = {n: tmp_path / f"{n}p" for n in (1, 2, 3)}
    run_parallel(
        [(launch(copy, n, *SAMPLED, "--output-dir", out), {}, tmp_path) for n, out in outs.items()],
        at_once=2,
    )
    reference = draws(outs[1])
    assert sorted(reference) == [0, 1, 2] and all(
        sum(c.values()) == 640 for c in reference.values()
    )
    for n in (2, 3):
        assert draws(outs[n]) == reference  # the same multiset each epoch, over all ranks
        assert max_weight_difference(outs[n], outs[1]) <= 1e-5
    assert reference[0] != reference[1]  # a new draw each epoch
    # the rare class: 8 % of the set, drawn with weight 5 of 1, is about 30 % of the draws
    share = rare_share(reference)
    assert 0.24 < share < 0.37, share
    assert metrics(outs[1])[-1]["val_acc"] > 0.8, metrics(outs[1])

    # preempted in epoch 2 (forward 1 is the start-up check's), continued with the same command on 2 processes
    stopped = tmp_path / "stopped"
    command = launch(copy, 2, *SAMPLED, "--output-dir", stopped)
    first = run(command, env={"SIGTERM_AT_FORWARD": str(1 + 10 + 4)}, check=False, cwd=tmp_path)
    assert first.returncode != 0 and "stopped by SIGTERM after step" in first.stderr, first.stderr
    state = torch.load(stopped / "checkpoint.pt", weights_only=True)
    assert state["epoch"] == 1 and 0 < state["step"] < 10, (
        state["epoch"],
        state["step"],
    )  # mid-epoch 2
    run(command, cwd=tmp_path)
    assert max_weight_difference(stopped, outs[2]) <= 1e-6
    assert [m["val_loss"] for m in metrics(stopped)] == pytest.approx(
        [m["val_loss"] for m in metrics(outs[2])], abs=1e-6
    )


def rare_share(epochs: dict[int, Counter]) -> float:
    """The rare class's share of the draws, its labels made as the user's Dataset makes them."""
    from test_your_own_data import users_code

    labels = users_code(YOUR_IMBALANCED)["Imbalanced"](640, seed=1).labels
    drawn = sum((c for c in epochs.values()), Counter())
    return sum(k for i, k in drawn.items() if labels[i] == 3) / sum(drawn.values())
