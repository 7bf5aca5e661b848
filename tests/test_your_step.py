"""A step of the user's own (train_step at the top of a copy of distributed.py, beside the plug points) keeps what
the loop around it guarantees: 2 processes with batch B train what 1 process does with 2B, a run stopped and
continued what a straight run does, each step's record once; a frozen model beside the trained one (build_frozen)
is in no optimizer and no saved file."""

from __future__ import annotations

import pytest
import torch

from processes import OFFLINE, max_weight_difference, metrics, run_parallel, steps
from test_your_own_data import (
    COMMON,
    YOUR_CLASSIFICATION,
    copy_with_your_functions,
    launch,
    users_code,
)

YOUR_DENOISING = '''
class Vectors(torch.utils.data.Dataset):
    """Vectors of 16 on a plane of 4; each sample is its own target (the clean vector to reconstruct)."""

    def __init__(self, size: int, seed: int):
        basis = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
        self.x = torch.randn(size, 4, generator=torch.Generator().manual_seed(seed)) @ basis

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.x[index]


def build_datasets(args):
    return Vectors(512, seed=1), Vectors(203, seed=2), 16


def build_model(args, num_classes):
    return nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 16))


def compute_loss(outputs, targets):
    return F.mse_loss(outputs, targets)


def train_step(run, inputs, targets) -> dict:
    """A denoising autoencoder: the inputs corrupted, the clean ones reconstructed."""
    model, optimizer = run.model, run.optimizer
    # each sample corrupted by its own values: alike on any number of processes
    noisy = inputs + 0.5 * torch.sin(3 * inputs)
    outputs = model(noisy)
    loss = compute_loss(outputs, inputs)  # the loss reads the inputs
    optimizer.zero_grad(set_to_none=True)
    run.backward(loss)
    optimizer.step()
    run.scheduler.step()
    return dict(loss=loss, outputs=outputs)
'''


def test_a_denoising_step_of_yours_trains_on_2_processes_what_1_does_and_continues_exactly(
    tmp_path,
):
    """The user's train_step corrupts the inputs and reconstructs them: 2 x 16 == 1 x 32 (1e-5), a run stopped
    after its first epoch and continued == the straight run, each step's record once, and the validation loss falls below a third of the untrained one."""
    script = copy_with_your_functions("distributed.py", tmp_path / "copy", YOUR_DENOISING)
    flags = [*COMMON, "--print-freq", "4", "--optimizer", "adamw", "--lr", "0.03"]
    runs = {
        "one": launch(script, 1, *flags, "--output-dir", tmp_path / "one"),
        "two": launch(script, 2, *flags, "--output-dir", tmp_path / "two"),
        "stopped": launch(
            script, 2, *flags, "--stop-after", "1", "--output-dir", tmp_path / "stopped"
        ),
    }
    run_parallel([(cmd, OFFLINE, tmp_path) for cmd in runs.values()])
    continued = launch(script, 2, *flags, "--output-dir", tmp_path / "stopped")
    run_parallel([(continued, OFFLINE, tmp_path)])
    one, two, stopped = (tmp_path / name for name in runs)
    differences = max_weight_difference(two, one), max_weight_difference(stopped, two)
    print(f"denoising: 2 x 16 against 1 x 32 {differences[0]:.2g}, continued {differences[1]:.2g}")
    assert differences[0] <= 1e-5 and differences[1] <= 1e-6, differences
    losses = [m["val_loss"] for m in metrics(two)]
    # below a third of what predicting 0 scores: the validation set's mean square
    untrained = users_code(YOUR_DENOISING)["Vectors"](203, seed=2).x.pow(2).mean().item()
    assert losses == sorted(losses, reverse=True) and losses[-1] < untrained / 3, (
        losses,
        untrained,
    )
    assert [m["val_images"] for m in metrics(two)] == [203] * 3  # each validation sample once
    # every training record once, in order, the same over the continuation
    for out in (two, stopped):
        trained = [r["global_step"] for r in steps(out) if "train_loss" in r]
        assert trained == sorted(set(trained)) and trained[-1] == 3 * 512 // 32, trained
    train_losses = [r["train_loss"] for r in steps(two) if "train_loss" in r]
    continued_losses = [r["train_loss"] for r in steps(stopped) if "train_loss" in r]
    assert continued_losses == pytest.approx(train_losses, rel=1e-5)


YOUR_DISTILLATION = (
    YOUR_CLASSIFICATION
    + '''

def build_frozen(args, num_classes):
    # a teacher of fixed weights, larger than the student (a trained one would be loaded here)
    with torch.random.fork_rng():
        torch.manual_seed(7)
        teacher = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, num_classes))
    return {"teacher": teacher}


def train_step(run, inputs, targets) -> dict:
    """Distillation: the labels' loss and the divergence from the frozen teacher's softened scores."""
    model, optimizer = run.model, run.optimizer
    outputs = model(inputs)
    with torch.no_grad():
        taught = run.frozen["teacher"](inputs)
    soft = F.kl_div(F.log_softmax(outputs / 2, 1), F.softmax(taught / 2, 1), reduction="batchmean")
    loss = compute_loss(outputs, targets) + soft
    optimizer.zero_grad(set_to_none=True)
    run.backward(loss)
    optimizer.step()
    run.scheduler.step()
    return dict(loss=loss, outputs=outputs)
'''
)


def test_a_frozen_teacher_is_on_no_optimizer_and_in_no_saved_file_and_distills_alike_on_2_and_1(
    tmp_path,
):
    """A student distilled from a frozen teacher (build_frozen, used in the user's train_step): 2 x 16 == 1 x 32
    (1e-5); checkpoint.pt, model_ema.pt and model_best.pt hold the student's 4 tensors alone, its optimizer the
    student's parameters alone; the teacher's size said once; the student learns."""
    script = copy_with_your_functions("distributed.py", tmp_path / "copy", YOUR_DISTILLATION)
    flags = [*COMMON, "--ema", "0.9", "--keep-best", "val_acc"]
    one, two = tmp_path / "one", tmp_path / "two"
    results = run_parallel(
        [
            (launch(script, 1, *flags, "--output-dir", one), OFFLINE, tmp_path),
            (launch(script, 2, *flags, "--output-dir", two), OFFLINE, tmp_path),
        ]
    )
    difference = max_weight_difference(two, one)
    print(f"distillation: 2 x 16 against 1 x 32 {difference:.2g}")
    assert difference <= 1e-5
    student = ["1.weight", "1.bias", "3.weight", "3.bias"]
    checkpoint = torch.load(two / "checkpoint.pt", weights_only=True)
    assert list(checkpoint["model"]) == student
    for name in ("model_ema.pt", "model_best.pt"):
        assert list(torch.load(two / name, weights_only=True)) == student, name
    assert sum(len(g["params"]) for g in checkpoint["optimizer"]["param_groups"]) == len(student)
    # said once, by rank 0: 64 x 128 + 128 + 128 x 4 + 4 parameters
    assert results[1].stdout.count("frozen teacher: 8,836 parameters") == 1, results[1].stdout
    assert metrics(two)[-1]["val_acc"] >= 0.8, metrics(two)
