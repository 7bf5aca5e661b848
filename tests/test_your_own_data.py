"""A user copies one script and utils.py and replaces build_datasets(), build_model(), compute_loss() and
collate() with their own: a plain Dataset and an MLP, another task (regression), dict inputs, a model with a
head that gets no gradient, one that diverges. Each trains as the built-in classification does, or ends in one line."""

from __future__ import annotations

import ast
import datetime
import re
import sys
import math
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

import utils
from extras import checks, stalls
from extras.metrics import Meter
import smallest_copy as smallest
from processes import (
    OFFLINE,
    PYTHON,
    ROOT,
    assert_wandb_equals_the_records,
    ends_every_rank_with,
    max_weight_difference,
    metrics,
    run,
    run_parallel,
    steps,
    weights,
)
from projects import (
    COMMON,
    PLUG_POINTS,
    YOUR_CLASSIFICATION,
    YOUR_CLASSIFICATION_LOSS,
    YOUR_DICT_INPUTS,
    YOUR_REGRESSION,
    copy_with_your_functions,
    launch,
    users_code,
)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory) -> Path:
    """The user's regression trained by their copy of dataparallel.py, one process on the CPU: the reference
    (tests/test_launch_variants.py shows that it equals distributed.py in one process)."""
    base = tmp_path_factory.mktemp("yours")
    script = copy_with_your_functions("dataparallel.py", base / "copy", YOUR_REGRESSION)
    run([PYTHON, script, *COMMON, *TRACKED, "--output-dir", base / "out"], cwd=base, env=OFFLINE)
    return base / "out"


def untrained_regression_loss() -> float:
    """The validation loss of predicting 0, as an untrained model about does: the targets' mean square."""
    return users_code(YOUR_REGRESSION)["Line"](203, seed=2).y.pow(2).mean().item()


# every script also keeps a moving average of the weights and logs to W&B (offline)
TRACKED = ["--ema", "0.9", "--wandb", "ddp-scripts-tests"]
# (script, processes, extra flags, equal to one process with the whole batch?)
CASES = {
    "distributed.py": ("distributed.py", 2, [], True),
    "distributed_mp.py": ("distributed_mp.py", 2, [], True),
    "distributed_grad_accum.py": ("distributed_grad_accum.py", 2, ["--accum-steps", "2"], True),
    "dataparallel.py": ("dataparallel.py", 1, [], False),  # the reference itself
    "distributed_amp.py": (
        "distributed_amp.py",
        2,
        ["--amp-dtype", "bfloat16"],
        False,
    ),  # other arithmetic
    "distributed_diloco.py": (
        "distributed_diloco.py",
        2,
        [
            "--inner-steps",
            "1",
            "--outer-lr",
            "1",  # DDP's steps
            "--outer-momentum",
            "0",
        ],
        True,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_regression_task_trains_in_every_script(case, tmp_path, single_process):
    """A plain Dataset of float features and float targets, an MLP with one output and F.mse_loss; with --ema and
    --wandb, whose run holds every record once."""
    script, processes, flags, exact = CASES[case]
    out = single_process
    if script != "dataparallel.py":
        copy = copy_with_your_functions(script, tmp_path / "copy", YOUR_REGRESSION)
        out = tmp_path / "out"
        run(
            launch(copy, processes, *COMMON, *TRACKED, *flags, "--output-dir", out),
            cwd=tmp_path,
            env=OFFLINE,
        )
    epochs = metrics(out)
    losses = [m["val_loss"] for m in epochs]
    assert (
        losses == sorted(losses, reverse=True) and losses[-1] <= untrained_regression_loss() / 10
    ), losses
    print(f"{case}: validation loss by epoch {losses}, untrained {untrained_regression_loss():.3f}")
    assert all(
        m["train_acc"] is None and m["val_acc"] is None for m in epochs
    )  # no made-up accuracy
    assert [m["val_images"] for m in epochs] == [203] * 3  # each validation input once
    assert epochs[-1]["tflops"] > 0  # FLOPs counted on a real batch of the user's inputs
    assert list(weights(out)) == ["0.weight", "0.bias", "2.weight", "2.bias"]  # plain keys
    if exact:  # the weights and their moving average
        assert max_weight_difference(out, single_process) <= 1e-5
    assert_wandb_equals_the_records(out, runs=1)
    assert all(m["val_loss_ema"] < untrained_regression_loss() / 10 for m in epochs[1:])


@pytest.mark.parametrize(
    "script, flags", [("distributed.py", []), ("distributed_amp.py", ["--amp-dtype", "bfloat16"])]
)
def test_dict_inputs_reach_the_model_as_keyword_arguments(script, flags, tmp_path):
    copy = copy_with_your_functions(script, tmp_path / "copy", YOUR_DICT_INPUTS)
    out = tmp_path / "out"
    run(launch(copy, 2, *COMMON, *flags, "--output-dir", out), cwd=tmp_path)
    assert metrics(out)[-1]["val_acc"] > 0.9, metrics(out)  # chance is 0.25
    assert [m["val_images"] for m in metrics(out)] == [203] * 3


def test_parameters_without_gradient_are_named_and_train_with_the_flag(tmp_path):
    """An auxiliary head that forward never uses: DDP would fail in the second step with a page of text.
    A branch used in training mode only does get gradients and is not named."""
    yours = YOUR_CLASSIFICATION.replace(
        """def build_model(args, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, num_classes))""",
        """\
class WithSpareHead(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh())
        self.train_only, self.head, self.aux = nn.Linear(32, 32), nn.Linear(32, num_classes), nn.Linear(32, 3)

    def forward(self, x):
        h = self.body(x)
        return self.head(h + 0.1 * self.train_only(h) if self.training else h)


def build_model(args, num_classes):
    return WithSpareHead(num_classes)""",
    )
    copy = copy_with_your_functions("distributed.py", tmp_path / "copy", yours)
    failed = run(
        launch(copy, 2, *COMMON, "--output-dir", tmp_path / "out"), cwd=tmp_path, check=False
    )
    line = (
        "error: 2 parameters get no gradient (aux.weight, aux.bias): --find-unused-parameters lets DDP "
        "train such a model, or leave them out of it"
    )
    ends_every_rank_with(failed, line, ranks=2)
    assert "reduction" not in failed.stderr  # not DDP's page about it
    print(line)
    out = tmp_path / "flag"
    run(launch(copy, 2, *COMMON, "--find-unused-parameters", "--output-dir", out), cwd=tmp_path)
    assert metrics(out)[-1]["val_acc"] > 0.9, metrics(out)


def test_a_diverging_run_stops_and_keeps_its_last_finite_checkpoint(tmp_path):
    """Outputs that turn NaN in epoch 2 (20 steps an epoch, +1 for the start-up check): every rank stops at
    the epoch's last step, whose record sees the NaN loss, with one line, and neither the NaN weights nor a NaN
    epoch are written."""
    yours = YOUR_CLASSIFICATION.replace(
        """def build_model(args, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, num_classes))""",
        """\
class TurnsNaN(nn.Sequential):
    calls = 0

    def forward(self, x):
        self.calls += self.training
        return super().forward(x) * (float("nan") if self.calls > 25 else 1.0)


def build_model(args, num_classes):
    return TurnsNaN(nn.Flatten(), nn.Linear(64, num_classes))""",
    )
    copy = copy_with_your_functions("distributed.py", tmp_path / "copy", yours)
    out = tmp_path / "out"
    result = run(launch(copy, 2, *COMMON, "--output-dir", out), cwd=tmp_path, check=False)
    line = (
        "error: training diverged: the loss or the weights became NaN or infinite by step 20 of epoch 2: "
        "lower --lr (peak 0.05) or lengthen --warmup (0.1), or use --clip-grad; only finite checkpoints were saved"
    )
    ends_every_rank_with(result, line, ranks=2)
    print(line)
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert (state["epoch"], state["step"]) == (1, 0)
    assert all(torch.isfinite(w).all() for w in state["model"].values())
    assert [m["epoch"] for m in metrics(out)] == [1] and math.isfinite(
        metrics(out)[0]["train_loss"]
    )


def test_labels_outside_the_classes_end_every_rank_with_one_line_before_training(tmp_path):
    """On a GPU such a label would be a device-side assert that kills the process mid-run."""
    yours = YOUR_CLASSIFICATION.replace(
        "Blobs(203, seed=2), 4", "Blobs(203, seed=2), 3"
    )  # labels 0..3
    copy = copy_with_your_functions("distributed.py", tmp_path / "copy", yours)
    result = run(
        launch(copy, 2, *COMMON, "--output-dir", tmp_path / "out"), cwd=tmp_path, check=False
    )
    ends_every_rank_with(
        result,
        "error: class labels from 0 to 3 in the first batch, outside [0, 3) for the "
        "model's 3 outputs: check num_classes, or replace compute_loss",
        ranks=2,
    )
    assert not (tmp_path / "out" / "checkpoint.pt").exists()


def mse_per_sample(outputs, targets):
    return torch.nn.functional.mse_loss(outputs, targets, reduction="none")


def mse_per_sample_and_count(outputs, targets):
    return mse_per_sample(outputs, targets), len(targets)


def start_up_step(model, inputs, targets, compute_loss) -> tuple[float, float]:
    """checks.first_step_flops as the scripts call it, on a loader of these samples in one batch: the
    FLOPs of a sample and the convolutions' share (not whether the loss is a pair)."""
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(inputs, targets),
        batch_size=len(targets),
        collate_fn=utils.Counted(torch.utils.data.default_collate),
    )
    return checks.first_step_flops(
        model,
        loader,
        compute_loss,
        utils.build_parser("x").parse_args([]),
        torch.device("cpu"),
        unused_ok=False,
    )[:2]


BAD_TASKS = {  # (the model's outputs, targets, compute_loss, the line): what the start-up step refuses
    "one output under the default loss": (
        torch.nn.Linear(8, 1),
        torch.randn(4, 1),
        "default",
        "the model gives 1 output per sample, and cross-entropy over one class is always 0: "
        "check num_classes, or replace compute_loss (a regression: F.mse_loss)",
    ),
    "a loss per sample": (
        torch.nn.Linear(8, 1),
        torch.randn(4, 1),
        mse_per_sample,
        "compute_loss must return a scalar tensor or a (sum, count) pair, not shape (2, 1): reduce it, "
        "e.g. with .mean()",
    ),
    "a pair whose sum is per sample": (
        torch.nn.Linear(8, 1),
        torch.randn(4, 1),
        mse_per_sample_and_count,
        "compute_loss must return a scalar tensor or a (sum, count) pair, not (shape (2, 1), int): reduce it, "
        "e.g. with .mean()",
    ),
    # found by hand: the first backward's traceback ("element 0 of tensors does not require grad")
    "a loss detached from the model": (
        torch.nn.Linear(8, 1),
        torch.randn(4, 1),
        lambda outputs, targets: torch.nn.functional.mse_loss(outputs, targets).detach(),
        "compute_loss returned a loss with no gradient back to the weights: return it as computed from the "
        "outputs (not detached, not under torch.no_grad, in compute_loss or the model's forward)",
    ),
    "the default loss, labels not classes": (
        torch.nn.Linear(8, 3),
        torch.tensor([0, 1, 2, -1]),
        "default",
        "class labels from -1 to 2 in the first batch, outside [0, 3) for the model's 3 outputs: "
        "check num_classes, or replace compute_loss",
    ),
}


@pytest.mark.parametrize("case", BAD_TASKS)
def test_a_task_the_loss_cannot_mean_is_refused_by_the_start_up_step(case):
    """The scripts turn this UsageError into the one line above, on every rank."""
    model, targets, compute_loss, line = BAD_TASKS[case]
    if compute_loss == "default":  # the scripts' default body, recognised as such
        compute_loss = YOUR_CLASSIFICATION_LOSS
    with pytest.raises(utils.UsageError) as error:
        start_up_step(model, torch.randn(4, 8), targets, compute_loss)
    assert str(error.value) == line


class Stream(
    torch.utils.data.IterableDataset
):  # no length: its emptiness is not known before reading
    def __iter__(self):
        return iter([])


def frozen() -> torch.nn.Module:
    return torch.nn.Linear(8, 2).requires_grad_(False)


POINTS = torch.utils.data.TensorDataset(torch.randn(4, 8), torch.tensor([0, 1, 0, 1]))
NONE = torch.utils.data.TensorDataset(torch.randn(0, 8), torch.zeros(0, dtype=torch.long))
PLUGGED_WRONG = {  # what a plug point returned, what the scripts make of it, and the line
    "two sets": (
        checks.returned_datasets,
        (POINTS, POINTS),
        "build_datasets must return (train_set, val_set, num_classes), not tuple of 2",
    ),
    "no training samples": (
        checks.returned_datasets,
        (NONE, POINTS, 2),
        "build_datasets returned an empty training set: nothing to train on",
    ),
    "no validation samples": (
        checks.returned_datasets,
        (POINTS, NONE, 2),
        "build_datasets returned an empty validation set: give it samples, each counted once (a slice of "
        "the training data will do)",
    ),
    "a function for a model": (
        checks.returned_model,
        lambda inputs: inputs,
        "build_model must return an nn.Module, not function",
    ),
    "a model with nothing to train": (
        checks.returned_model,
        frozen(),
        "build_model's Linear has no parameter that requires a gradient: nothing to train (frozen weights "
        "need some left unfrozen, e.g. a new head)",
    ),
    "a collate that returns the inputs alone": (
        lambda collate: checks.collate_first(
            torch.utils.data.DataLoader(POINTS, collate_fn=utils.Counted(collate)), list(POINTS)
        ),
        lambda samples: torch.stack([inputs for inputs, _ in samples]),
        "collate must return one batch as (inputs, targets), not shape (2, 8)",
    ),
}


@pytest.mark.parametrize("case", PLUGGED_WRONG)
def test_a_plug_point_that_returns_another_form_is_refused_in_one_line(case):
    """Found by trying a user's slips by hand: each had ended in a traceback (an unpacking's, .to() on a function,
    the first backward's) or, for an empty validation set, trained and recorded val_loss 0.0000 of no sample. The
    scripts turn each UsageError into the one line on every rank (every script calls both checks: the recipe
    test)."""
    check, returned, line = PLUGGED_WRONG[case]
    with pytest.raises(utils.UsageError) as error:
        check(returned)
    assert str(error.value) == line
    # what is right passes as it is, a stream of unknown length too
    stream, model = Stream(), torch.nn.Linear(8, 2)
    assert checks.returned_datasets([POINTS, stream, 2]) == (POINTS, stream, 2)
    assert checks.returned_model(model) is model


class Ragged(
    torch.utils.data.Dataset
):  # sample 5 is one longer: found mid-epoch, not by the start-up check
    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.zeros(3 + (index == 5)), 0


def your_collate(samples):
    if len(samples) == 3:
        raise ValueError("your own collate's error")
    return torch.utils.data.default_collate(samples)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_batch_collate_cannot_make_mid_epoch_is_one_line_and_your_own_error_yours(workers):
    """Found by hand: a sample of another size past the start-up check's first samples ended its rank in a
    traceback mid-epoch (default_collate's, or a worker's around it). It is one line at the user's line, which a
    training loop says on every rank (stops.next_batch); an error the user's collate raises itself stays theirs."""
    loader = torch.utils.data.DataLoader(
        Ragged(), batch_size=2, num_workers=workers, collate_fn=utils.Counted(your_collate)
    )
    read = iter(loader)
    assert next(read)[0] == next(read)[0] == 2
    with pytest.raises(utils.UsageError) as error:
        next(read)
    assert re.fullmatch(
        r"collate cannot batch its samples: (stack expects each tensor to be equal size|Trying to resize storage"
        r" that is not resizable)[^\n]*, at your_collate \(test_your_own_data.py:\d+\); pad them",
        str(error.value),
    ), str(error.value)
    with pytest.raises(ValueError, match="your own collate's error"):
        utils.Counted(your_collate)([Ragged()[0]] * 3)


class YourModel(torch.nn.Linear):  # a user's own model, with a bug of its own on the first batch
    def forward(self, inputs):
        if inputs.shape[1] == 7:
            raise ValueError("your own error")
        return super().forward(inputs)


def test_the_users_own_error_at_the_start_up_step_is_theirs_and_a_librarys_refusal_one_line():
    """A ValueError raised by the user's forward is not a shape the model cannot take: it reaches them as it is, with
    their line; what torch refuses in their forward is one line, at their line; the same in their compute_loss."""
    with pytest.raises(ValueError, match="your own error") as error:
        start_up_step(
            YourModel(8, 3), torch.randn(4, 7), torch.tensor([0, 1, 2, 0]), YOUR_CLASSIFICATION_LOSS
        )
    assert error.traceback[-1].name == "forward" and error.traceback[-1].path == Path(__file__)
    with pytest.raises(
        utils.UsageError,
        # PyTorch's own words vary by version ("addmm: mat1 and mat2 shapes ..." from 2.15):
        # what matters is one line, the shapes it could not multiply and the user's line
        match=r"^the model cannot take the first batch's inputs: [^\n]*\(2x5 and 8x3\), at "
        r"forward \(test_your_own_data.py:\d+\)$",
    ):
        start_up_step(
            YourModel(8, 3), torch.randn(4, 5), torch.tensor([0, 1, 2, 0]), YOUR_CLASSIFICATION_LOSS
        )
    # and in compute_loss (found by hand: float labels, a model's tuple of outputs, each a traceback)
    with pytest.raises(
        utils.UsageError,
        match=r"^compute_loss cannot take the outputs and targets: expected target dtype to be Long or Byte, but "
        r"got Float, at your_loss \(test_your_own_data.py:\d+\)$",
    ):
        start_up_step(YourModel(8, 3), torch.randn(4, 8), torch.tensor([0.0, 1, 2, 0]), your_loss)
    with pytest.raises(ValueError, match="your own loss's error"):
        start_up_step(YourModel(8, 3), torch.randn(4, 8), torch.tensor([0, 1, 2, 0]), your_loss)


def your_loss(outputs, targets):
    if targets.dtype == torch.long:
        raise ValueError("your own loss's error")
    return torch.nn.functional.cross_entropy(outputs, targets)


@pytest.mark.parametrize(
    "error",
    [
        "ConnectionError('Connection refused by the hub')",
        "RuntimeError('Timed out reading shard 3')",
    ],
)
def test_an_error_of_the_users_code_that_mentions_connections_keeps_its_traceback(error, tmp_path):
    """Not taken for a failed collective (a dead peer's, whose words it shares): the user's stream's own error."""
    (tmp_path / "yours.py").write_text(
        f"import utils\n\n\ndef read_shard(teardown):\n    raise {error}\n\n\nutils.run_main(read_shard)\n"
    )
    result = run(
        [PYTHON, tmp_path / "yours.py"], env={"PYTHONPATH": str(ROOT)}, check=False, timeout=60
    )
    assert result.returncode == 1 and "distributed communication failed" not in result.stderr
    assert result.stderr.strip().splitlines()[-3:] == [
        '  File "' + str(tmp_path / "yours.py") + '", line 5, in read_shard',
        f"    raise {error}",
        error.replace("('", ": ").rstrip("')"),
    ]


def test_a_custom_loss_may_use_labels_the_default_could_not():
    """Not the default loss: an "ignore" label of 255 is the loss's business, not refused."""

    def with_ignore(outputs, targets):
        return torch.nn.functional.cross_entropy(outputs, targets, ignore_index=255)

    flops, convolutions = start_up_step(
        torch.nn.Linear(8, 3), torch.randn(4, 8), torch.tensor([0, 1, 255, 2]), with_ignore
    )
    assert (
        flops == 2 * (2 * 8 * 3) and convolutions == 0
    )  # the forward, the weights' gradient (the input needs none)


def test_the_built_in_fast_path_leaves_your_inputs_alone():
    """Inputs of a Dataset without a batch_transform reach the model exactly as it made them."""
    inputs = torch.randn(5, 1, 8, 8)
    batch = (inputs.clone(), torch.arange(5))
    moved, targets = utils.batch_to_device(
        batch,
        torch.device("cpu"),
        torch.utils.data.TensorDataset(inputs),
        channels_last=True,
        key=(0, 1),
    )
    assert torch.equal(moved, inputs) and torch.equal(targets, torch.arange(5))


def test_the_start_up_step_leaves_weights_statistics_and_random_streams_as_they_were():
    """It runs in training mode (a batch-norm model updates its running statistics, dropout draws), then puts
    everything back: a run trains exactly as if it had not happened."""
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.BatchNorm2d(4),
        torch.nn.Dropout(0.5),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 6 * 6, 3),
    )
    before, inputs = {k: v.clone() for k, v in model.state_dict().items()}, torch.randn(5, 3, 8, 8)
    rng = torch.get_rng_state()
    flops, convolutions = start_up_step(
        model, inputs, torch.tensor([0, 1, 2, 0, 1]), torch.nn.functional.cross_entropy
    )
    assert torch.equal(torch.get_rng_state(), rng)
    # a sample's forward: the convolution's 2 x 4 x 6 x 6 x 27 and the layer's 2 x 144 x 3; the backward twice the
    # layer's (its input's gradient and its weights') and the convolution's weights' alone (the input needs none)
    assert flops == 2 * 7776 + 3 * 864 and convolutions == pytest.approx(2 * 7776 / flops)
    assert all(
        torch.equal(v, before[k]) for k, v in model.state_dict().items()
    )  # num_batches_tracked too
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    "outputs, targets, accuracy",
    [
        (torch.tensor([[2.0, 1.0], [0.0, 3.0]]), torch.tensor([0, 0]), 0.5),  # classification
        (
            {"logits": torch.tensor([[2.0, 1.0], [0.0, 3.0]])},
            torch.tensor([0, 1]),
            1.0,
        ),  # a dict or ModelOutput
        (
            torch.zeros(2, 3, 4, 4).index_fill_(
                1, torch.tensor([2]), 1.0
            ),  # segmentation: class 2 everywhere,
            torch.full((2, 4, 4), 2).index_fill_(2, torch.tensor([0]), 255),
            1.0,
        ),  # one column "ignore" (255)
        (torch.randn(2, 1), torch.randn(2, 1), None),  # regression
        (
            torch.randn(2, 1),
            torch.tensor([[0], [1]]),
            None,
        ),  # one logit for two classes: not argmax-able
        (torch.randn(2, 4), torch.rand(2, 4).round(), None),  # multi-label 0/1 floats
    ],
)
def test_accuracy_is_measured_only_where_targets_are_class_indices(outputs, targets, accuracy):
    meter = Meter(torch.device("cpu"))
    meter.update(torch.tensor(0.5), outputs, targets, samples=2)
    totals = meter.all_ranks()
    assert (totals.mean_loss(), totals.accuracy(), totals.samples) == (0.5, accuracy, 2)


def test_the_meter_adds_up_the_steps_it_keeps_as_each_step_alone():
    """The meter keeps each step's loss and guesses, and adds them up every 32 steps, past 2**20
    target elements (a segmentation's batch), where the classes change and at a record: its sums
    are those of each step alone, added."""
    generator = torch.Generator().manual_seed(0)
    meter = Meter(torch.device("cpu"))
    loss = correct = scored = 0
    for step in range(1, 81):
        classes = 3 if step <= 50 else 5
        size = (600, 600) if step % 20 == 0 else ()  # 1.44M target elements
        outputs = torch.randn(4, classes, *size, generator=generator)
        # -1 and classes are labels that are no class: never scored
        targets = torch.randint(-1, classes + 1, (4, *size), generator=generator)
        mean = torch.rand((), generator=generator)
        meter.update(mean, outputs, targets, samples=4)
        assert len(meter.totals) < 32 and meter.kept <= 2**20
        loss += mean.item() * 4
        correct += (outputs.argmax(1) == targets).sum().item()
        scored += ((targets >= 0) & (targets < classes)).sum().item()
        if step in (45, 80):  # a record's sums, and the epoch's
            totals = meter.all_ranks()
            assert (totals.correct, totals.scored, totals.samples) == (correct, scored, 4 * step)
            assert totals.loss == pytest.approx(loss, rel=1e-6)


def test_a_loss_sum_and_count_is_logged_per_item_and_samples_as_samples():
    """Two batches of 2 samples with 3 and 9 tokens: the mean over 12 tokens, not the mean of the batches' means."""
    meter = Meter(torch.device("cpu"))
    meter.update(
        (torch.tensor(6.0), 3), torch.randn(2, 4, 5), torch.zeros(2, 5, dtype=torch.long), samples=2
    )
    meter.update(
        (torch.tensor(9.0), torch.tensor(9)),
        torch.randn(2, 4, 5),
        torch.zeros(2, 5, dtype=torch.long),
        samples=2,
    )
    totals = meter.all_ranks()
    assert (totals.mean_loss(), totals.samples) == (15 / 12, 4)


def test_flags_are_also_accepted_in_snake_case():
    """Other tutorials write --batch_size=128 and --output_dir; values keep their underscores."""
    args = utils.build_parser("x").parse_args(
        [
            "--batch_size=128",
            "--output_dir",
            "my_out",
            "--data-dir=a_b",
            "--no_augment",
            "--fake_size",
            "64",
        ]
    )
    assert (args.batch_size, args.output_dir, args.data_dir, args.no_augment, args.fake_size) == (
        128,
        "my_out",
        "a_b",
        True,
        64,
    )


def code_lines(path: Path) -> int:
    """A script's statements: its size whatever the layout (ruff lays lines out at 100 columns)."""
    return sum(1 for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.stmt))


# Each script's statements (imports too) as issue 91 left them (2026-12-02): the step a user
# rewrites (train_step) at the top, what happens around it behind two calls (then extras/loops.py), the
# rendezvous, DDP's flags and the validation record in utils/ once. None may grow without a reason
# written here.
SCRIPT_LINES = {
    "dataparallel.py": 217 + 10 + 24 + 18 + 7 + 3 + 4 + 6 + 15 + 4,
    # and the three scripts that had registered batches.CountWeights: PyTorch's bf16_compress_hook
    # for --comm-hook, its import (1; utils/ 43 fewer)
    "distributed.py": 238 + 1 + 21 + 24 + 18 + 7 + 3 + 7 + 6 + 15 + 4,
    "distributed_mp.py": 290 + 1 + 17 + 24 + 16 + 6 + 3 + 7 + 6 + 15 + 4,
    "distributed_amp.py": 258 + 1 + 26 + 24 + 18 + 7 + 3 + 7 + 6 + 15 + 4,
    # issue 92, item 3: train_step_over_whole_batch, the GradCache step, and its call (32)
    "distributed_grad_accum.py": 268 + 32 + 20 + 29 + 50 + 18 + 7 + 3 + 5 + 6 - 77 + 15 + 2 + 4,
    "distributed_fsdp.py": 410 + 21 + 24 + 13 + 3 + 1 - 4 + 5 + 2,
    "distributed_diloco.py": 297 + 20 + 24 + 12 + 18 + 7 + 3 + 4 + 6 + 1 + 15 + 4,
}
# The issue on the minimal copy added to each: eval_step beside train_step (4, AMP's autocast 6);
# the blocks that import an extra where it is used (Slurm's and torchrun's elastic store at the
# rendezvous, a batch the ranks do not divide, your sampler, TensorBoard and W&B, --sync-bn on
# CPU, image folders: 1 to 4 each), NCCL's Flight Recorder set where the script joins an NCCL group (2);
# AMP's loss_scale, out of utils/ (5); the loop written out, extras/loops.py's EpochSteps gone (24;
# accumulation's micro-batches on the device, 29); what one script alone uses moved into it out of
# the extras every copy holds (accumulation's Joined, model_streams and draw_again, 50; DiLoCo's
# gather_on_rank_0, 12). Then the extras at the top moved into the blocks that use them (18 each):
# --workers' (workers, 6), your metrics' (scores, 6), --phases' and --profile's (profiles, 3),
# MFU's on a GPU (peaks, 3); mp.spawn's 2 fewer (its diff from distributed.py at 100 lines), FSDP's 5.
# The issue on a newcomer's terminal added the live line's two blocks (5, its import and sys's: 7;
# mp.spawn imported sys already), and the run's picture's block (curves.svg: 3), in every script; FSDP's,
# at its bound of 400 statements, made room (3 in all): its gloo check moved into extras/checks.py, its
# checkpoint folder named where it is used, its latest checkpoint gathered with utils.all_gather_objects.
# Then the minimal copy's optimizer: the optimizer and its schedule in the core, and extras/optimizers.py's two
# other parts extras of their own, each imported in its block: --ema's average (extras/averages.py; its block 4,
# where there was 1 line, and the if before its update 1: 4 in every script) and models trained together
# (extras/together.py; its import, and --compile's branch for them: 3 more in the three scripts that train them);
# accumulation's DDP options named as distributed.py names them (1, its diff from distributed.py unchanged); FSDP's
# 3 fewer elsewhere (its saves' group made where it is passed, the unwrapped model where it is loaded, the restore
# called once with or without a checkpoint). Then the two extras on by default entered by their blocks, which
# --no-watchdog and --no-sample-seeds leave out (6 in every script: each block's if and import, the watchdog's
# stand-in, the seeded loaders' default); FSDP's made room by its write_error, now extras/checkpoints.py's (9), its
# spare validation batch's first_samples extras/checks.py's, and contextlib no longer imported there (1).
# DiLoCo's validation record in two plain lines, not a dict(**...) of a conditional (1).
# Accumulation's GradCache step (train_step_over_whole_batch, Joined, model_streams, draw_again) moved into
# extras/gradcache.py, an extra of its own, as the issue on the minimal copy names the whole batch's; a batch that
# does not split into --accum-steps said by parse_args, the step's samples named as distributed.py names them, the
# extra imported in the block that steps with it (77 fewer in all).
# The start-up checks (extras/checks.py) entered by their three blocks, which --no-checks leaves out (15 in every
# script: each block's if and import, what build_datasets returned named before it is unpacked, the frozen models
# moved to the device in the script, the output directory's check inline); FSDP's 5, its memory check
# (check_state_fits, 12) now extras/checks.py's, in a fourth block, and its gloo check the core's. Accumulation's
# loss over the whole batch, which the start-up step finds, one line at the first step under --no-checks (2).
# A step whose loss run.backward() did not weight (loss.backward(), wrong where the ranks' parts differ) one line
# at its first step (4 in every script: the field run.backward() sets, and the check after train_step; FSDP's 2, its
# step's samples named in one statement and its steps' generator in the for's header).


def statements(path: Path) -> int:
    """A module's statements, its imports and docstrings aside."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0])
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
        and ast.get_docstring(node, clean=False) is not None
    }
    return sum(
        1
        for node in ast.walk(tree)
        if isinstance(node, ast.stmt)
        and not isinstance(node, (ast.Import, ast.ImportFrom))
        and id(node) not in docstrings
    )


# The imports of one extra by another: none, each extra imports the core alone (a script wires them together).
EXTRAS_IMPORTING_EXTRAS: dict[str, set[str]] = {}
# The extras a script still imports at its top rather than in the block that uses them: a ratchet toward none.
EXTRAS_AT_THE_TOP = {
    *"checkpoints metrics".split(),
    "batches",  # distributed_grad_accum.py's micro-batches
}
# What a user copies (distributed.py, utils.py and every extra), in statements (../shared/tools/statements): the
# issue on the minimal copy bounds it by 2,989, its figure before the core was one file; the issue on a newcomer's
# terminal lets the live line add its own (extras/live.py 108, the watchdog's and the records' notes of it 4,
# its blocks in distributed.py 5, the core's --no-live-line with a check merged -1: 116 in all) and the run's
# picture (extras/curves.py 52, its block 2), each rank's phases in it and the user's first metric where no
# accuracy is recorded (27); FSDP's gloo check moved into extras/checks.py (5) to make room in distributed_fsdp.py
# for its live line and picture; the core's check_args shorter by 4 and its line for an extra the copy lacks 3.
# The minimal copy's optimizer in the core: --ema's average and models trained together extras of their own, their
# blocks in distributed.py (5 fewer in all). The watchdog and each sample's seeds entered by their blocks, which
# --no-watchdog and --no-sample-seeds leave out (distributed.py 4; the core's two flags and the watchdog's stand-in,
# NoWatchdog, 9, for which first_samples, the start-up step's, moved out of it into extras/checks.py, 7; the
# loaders' generator made in the scripts, not extras/seeds.py, -2; together's one marker 2: 13 in all); FSDP's
# write_error, which makes room for them in distributed_fsdp.py, in extras/checkpoints.py (7), and first_failure, a
# sharded load's error as its first rank's (dcp's, a BaseException, had escaped FSDP's `except Exception`: 3).
# Accumulation's GradCache step an extra of its own, extras/gradcache.py (73: its train_step, Joined and the model's
# random streams, the buffers kept inline and the loss weighted by utils.loss_for_backward), out of the script, whose
# diff from distributed.py is 190 lines, not 321; a contrastive loss without accumulation copies extras/batches.py
# alone.
# The start-up checks an extra entered by its blocks, which --no-checks leaves out: distributed.py's three blocks
# (11); the core still 600 with its flag, first_samples (the FSDP script's spare batch) and the gloo check (a guard
# of FSDP's average, not a start-up check: on under --no-checks), all out of extras/checks.py, in 7 fewer elsewhere;
# extras/checks.py 6 fewer (those two out, the output directory's check inline in the scripts, the stream's for a
# user's sampler extras/samplers.py's, 3; FSDP's memory check, 12, and the frozen models in it, 3, in): 8 in all.
# A step whose loss run.backward() did not weight one line at its first step: distributed.py 4, and GradCache's step
# (extras/gradcache.py), which weights its loss itself, marks it so (1).
COPY_STATEMENTS = 2982 + 116 + 54 + 27 + 5 - 1 - 5 + 13 + 7 + 3 + 73 + 8 + 5


# `diff distributed.py X.py`, its lines marked < or >: a short lesson about X. The issue on the minimal copy bounds
# AMP's, mp.spawn's and accumulation's by 100 each; accumulation's (its micro-batch loop and a (sum, count) loss
# divided once; GradCache's step now extras/gradcache.py's) is a ratchet still over it: 6 more for its line where
# --no-checks leaves out the start-up step that finds a loss over the whole batch.
DIFF_LINES = {"distributed_amp.py": 100, "distributed_mp.py": 100, "distributed_grad_accum.py": 196}


@pytest.mark.skipif(shutil.which("diff") is None, reason="needs diff")
def test_each_script_is_distributed_py_and_a_short_lesson():
    """What `diff distributed.py distributed_amp.py` (or mp, or accumulation) shows is that approach's lesson:
    at most DIFF_LINES changed lines."""
    changed = {}
    for script in DIFF_LINES:
        result = subprocess.run(
            ["diff", "distributed.py", script], cwd=ROOT, capture_output=True, text=True, timeout=30
        )
        changed[script] = sum(line[:1] in "<>" for line in result.stdout.splitlines() if line)
    assert all(changed[script] <= bound for script, bound in DIFF_LINES.items()), changed


# The smallest copy that trains a user's project: a script, the core and the extras its top imports (these, and
# accumulation's batches), the blocks that a run enters unasked deleted with their extras' files
# (tools/smallest_copy.py): the run's picture (always), the live line (a terminal), MFU's peaks and DataLoader
# workers (a GPU), the torchrun agent's store (torchrun), and the three extras on by default, the watchdog, each
# sample's seeds and the start-up checks. Every other extra's block is entered by a flag or a plug point's return. Kept, the blocks of the
# three on by default are left out by SMALLEST_FLAGS.
SMALLEST_COPY = {*EXTRAS_AT_THE_TOP - {"batches"}, "__init__"}
SMALLEST_FLAGS = ("--no-watchdog", "--no-sample-seeds", "--no-checks")


def smallest_copy(
    script: str, directory: Path, yours: str | None, deleted: tuple[str, ...] = smallest.MACHINE
) -> Path:
    """script copied with yours as its smallest copy (tools/smallest_copy.py's): the blocks of each extra named in
    `deleted` removed (by default those the machine enters; the three on by default are left to SMALLEST_FLAGS), and
    the files of every extra its top does not import."""
    copy = smallest.shrink(copy_with_your_functions(script, directory, yours), deleted)
    assert smallest.top_extras(copy) <= SMALLEST_COPY | {"batches"}
    return copy


@pytest.mark.parametrize(
    "script",
    [
        # a real torchrun: its agent's store, which a script's block takes a fresh part of
        pytest.param("distributed.py", marks=pytest.mark.real_launch),
        *sorted({*CASES, "distributed_fsdp.py"} - {"distributed.py"}),
    ],
)
def test_the_smallest_copy_trains_what_the_whole_copy_does(script, tmp_path):
    """A user deletes an extra by deleting its file and its blocks: a script, utils.py and the extras its top
    imports, with the blocks the machine enters without a flag deleted (smallest.MACHINE) and every other extra's file
    (their blocks not entered by these flags, SMALLEST_FLAGS leaving out the watchdog's and the seeds'), train the user's own classification on 2 processes (dataparallel.py:
    1) to the weights of the whole copy bit for bit, and to its records' losses, accuracies, learning rates and
    validation samples; it writes no curves.svg. distributed.py's, launched by a real torchrun, holds the statements
    the README says; a flag whose extra it lacks (--phases) ends every rank with one line naming the file and the
    script's line that imports it."""
    whole = copy_with_your_functions(script, tmp_path / "whole", YOUR_CLASSIFICATION)
    least = smallest_copy(script, tmp_path / "smallest", YOUR_CLASSIFICATION)
    imported = {
        alias.name
        for node in ast.walk(ast.parse(least.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module == "extras"
        for alias in node.names
    }
    assert not imported & {"curves", "live", "peaks", "workers"}, imported
    processes = 1 if script == "dataparallel.py" else 2
    run_parallel(
        [
            (
                launch(
                    copy,
                    processes,
                    *COMMON,
                    *flags,
                    "--output-dir",
                    tmp_path / f"{copy.parent.name}-out",
                ),
                {},
            )
            for copy, flags in ((whole, ()), (least, SMALLEST_FLAGS))
        ]
    )
    out, reference = tmp_path / "smallest-out", tmp_path / "whole-out"
    assert max_weight_difference(out, reference) == 0
    trained = ("global_step", "train_loss", "train_acc", "lr", "val_loss", "val_acc", "val_images")
    assert [[r.get(k) for k in trained] for r in steps(out)] == [
        [r.get(k) for k in trained] for r in steps(reference)
    ]
    assert metrics(out)[-1]["val_images"] == 203 and metrics(out)[-1]["val_acc"] > 0.9
    assert (reference / "curves.svg").exists() and not (out / "curves.svg").exists()
    if script == "distributed.py":
        # tools/smallest_copy.py's copy, its own plug points
        counted = smallest_copy(
            script, tmp_path / "counted", None, smallest.MACHINE + smallest.ON_BY_DEFAULT
        )
        copied = [counted, ROOT / "utils.py", *(counted.parent / "extras").glob("*.py")]
        said = re.search(
            r"a run enters unasked: ([\d,]+) statements", (ROOT / "README.md").read_text()
        )
        assert sum(statements(path) for path in copied) == int(said[1].replace(",", "")), said[0]
        # a flag whose extra this copy lacks: one line naming the file and the block's line
        refused = run(
            launch(
                least,
                2,
                *COMMON,
                *SMALLEST_FLAGS,
                "--phases",
                "--output-dir",
                tmp_path / "refused",
            ),
            check=False,
        )
        ends_every_rank_with(
            refused, "error: extras/profiles.py is not in this copy, at main (distributed.py:"
        )


# YOUR_CLASSIFICATION, and what a test asks of it by its environment: a SIGTERM to rank 1 at its STOP_AT-th loss (a
# scheduler's preemption mid-epoch), an error of its own in rank 1's build_datasets (FAIL), an atexit handler that
# notes each rank's end in the folder ENDS
YOUR_CLASSIFICATION_TRIED = """
import atexit
import os
import signal

LOSSES = [0]

if "ENDS" in os.environ:
    atexit.register(lambda: Path(os.environ["ENDS"], f"atexit-rank{os.environ.get('RANK', '0')}").touch())
""" + YOUR_CLASSIFICATION.replace(
    "def build_datasets(args):\n",
    "def build_datasets(args):\n"
    "    if os.environ.get('FAIL') and os.environ.get('RANK') == '1':\n"
    "        raise ValueError('your data is not there')\n",
).replace(
    "def compute_loss(outputs, targets):\n",
    "def compute_loss(outputs, targets):\n"
    "    LOSSES[0] += 1\n"
    "    if os.environ.get('RANK') == '1' and LOSSES[0] == int(os.environ.get('STOP_AT', 0)):\n"
    "        os.kill(os.getpid(), signal.SIGTERM)\n",
)


@pytest.mark.real_launch
def test_the_smallest_copy_keeps_the_cores_guarantees(tmp_path):
    """The smallest copy of distributed.py as tools/smallest_copy.py writes it (the script, utils.py and the extras
    its top imports, the watchdog's and the seeds' blocks deleted too: no flag), with the user's own data, model and
    loss, under a real torchrun: 2 x 16 trains what 1 x 32 does (1e-5); SIGTERM to rank 1
    mid-epoch and the same command again equal the straight run (1e-6, the weights and steps.jsonl's losses,
    accuracies and learning rates); every validation sample counted once (203 of them); the user's atexit handler
    runs on every rank; an error of the user's own in rank 1's build_datasets ends both ranks within seconds (the
    core says it once, as it is; torchrun's agent ends the other rank), not zero. Its data draws nothing at random:
    what --no-sample-seeds gives up, a random transform drawn alike on any number of processes and in a continued
    run, is extras/seeds.py's (tests/test_randomness.py)."""
    script = smallest_copy(
        "distributed.py",
        tmp_path / "copy",
        YOUR_CLASSIFICATION_TRIED,
        smallest.MACHINE + smallest.ON_BY_DEFAULT,
    )
    assert {path.stem for path in (script.parent / "extras").glob("*.py")} == SMALLEST_COPY
    # the same as the tool writes it, as a user runs it (its own plug points replaced by yours)
    run(
        [PYTHON, ROOT / "tools" / "smallest_copy.py", "distributed.py", tmp_path / "written"],
        cwd=tmp_path,
    )
    written = sorted(
        str(path.relative_to(tmp_path / "written")) for path in (tmp_path / "written").rglob("*.py")
    )
    assert written == sorted(
        ["distributed.py", "utils.py", *(f"extras/{name}.py" for name in SMALLEST_COPY)]
    )
    own = smallest_copy(
        "distributed.py", tmp_path / "own", None, smallest.MACHINE + smallest.ON_BY_DEFAULT
    )
    assert (tmp_path / "written" / "distributed.py").read_text() == own.read_text()
    common = COMMON  # no flag: the blocks of the three extras on by default are deleted
    two, one, stopped, ends = (tmp_path / name for name in ("two", "one", "stopped", "ends"))
    ends.mkdir()
    results = run_parallel(
        [
            (launch(script, 2, *common, "--output-dir", two), {"ENDS": str(ends)}, tmp_path),
            (launch(script, 1, *common, "--output-dir", one), {}, tmp_path),
            (launch(script, 2, *common, "--output-dir", stopped), {"STOP_AT": "34"}, tmp_path),
        ],
        check=False,
    )
    assert [result.returncode for result in results[:2]] == [0, 0], (
        results[0].stderr + results[1].stderr
    )
    stop = "stopped by SIGTERM after step 8/20 of epoch 2, saved: the same command continues from there"
    assert results[2].returncode != 0 and stop in results[2].stderr, results[2].stderr
    # stopped mid-epoch 2 (20 steps an epoch; its 34th loss: 20, 7 validation batches', 7; no start-up step, checks'),
    # after the step that follows the signal (the ranks agree as each step begins)
    state = torch.load(stopped / "checkpoint.pt", weights_only=True)
    assert (state["epoch"], state["step"]) == (1, 8), (state["epoch"], state["step"])
    started = time.monotonic()
    failed = run(
        launch(script, 2, *common, "--output-dir", tmp_path / "failed"),
        env={"FAIL": "1"},
        check=False,
        cwd=tmp_path,
    )
    seconds = time.monotonic() - started
    run(launch(script, 2, *common, "--output-dir", stopped), cwd=tmp_path)
    assert max_weight_difference(one, two) <= 1e-5
    assert max_weight_difference(stopped, two) <= 1e-6
    trained = ("global_step", "train_loss", "train_acc", "lr", "val_loss", "val_acc", "val_images")
    # each record once, its numbers the straight run's
    for a, b in zip(steps(stopped), steps(two), strict=True):
        for key in trained:
            assert a.get(key) == b.get(key) or abs(a[key] - b[key]) <= 1e-6, (key, a, b)
    assert [r["val_images"] for r in metrics(two)] == [203] * 3
    assert {path.name for path in ends.iterdir()} == {"atexit-rank0", "atexit-rank1"}
    assert (
        failed.returncode != 0 and failed.stderr.count("ValueError: your data is not there") == 1
    ), failed.stderr
    assert seconds < 30, seconds
    print(
        f"the smallest copy: 2 x 16 against 1 x 32 {max_weight_difference(one, two):.2g}; its error ended both ranks in {seconds:.1f} s"
    )


def test_the_core_and_its_extras_wired_in_plain_sight():
    """The top level holds the seven scripts and the core, utils.py, which imports torch and the standard library
    alone, in at most 600 statements; the extras are modules of one concern in extras/ (each listed in its
    __init__'s docstring, at most 640 lines: metrics.py, the largest, 618), which import the core absolutely (`from utils import`, so that one sed
    renames it) and never one another (EXTRAS_IMPORTING_EXTRAS), with no cycle; a script imports an extra at its top
    only as EXTRAS_AT_THE_TOP still allows, any other inside the if of its block (or a plug point); nothing assigns another module's
    names or rebinds a global. What a user copies holds at most COPY_STATEMENTS."""
    scripts = sorted([*CASES, "distributed_fsdp.py"])
    assert sorted(path.name for path in ROOT.glob("*.py")) == sorted([*scripts, "utils.py"])
    core = ast.parse((ROOT / "utils.py").read_text())
    imported = {
        alias.name
        for node in ast.walk(core)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {node.module for node in ast.walk(core) if isinstance(node, ast.ImportFrom)}
    outside = {
        name for name in imported if name.split(".")[0] not in {*sys.stdlib_module_names, "torch"}
    }
    assert not outside, outside
    assert statements(ROOT / "utils.py") <= 600
    modules = {
        path.stem: path for path in (ROOT / "extras").glob("*.py") if path.stem != "__init__"
    }
    docstring = ast.get_docstring(ast.parse((ROOT / "extras" / "__init__.py").read_text()))
    listed = re.findall(r"^- (\w+): ", docstring, re.M)
    assert sorted(listed) == sorted(modules), (listed, sorted(modules))
    # the README's table of the extras: each one, with its statements as counted here
    rows = re.findall(r"^\| `(\w+)` \|.*\| (\d+) \|$", (ROOT / "README.md").read_text(), re.M)
    counted = {name: statements(path) for name, path in modules.items()}
    assert {name: int(count) for name, count in rows} == counted, counted
    copied = [ROOT / "distributed.py", ROOT / "utils.py", *(ROOT / "extras").glob("*.py")]
    assert sum(statements(path) for path in copied) <= COPY_STATEMENTS
    # each script: the extras at its top no more than EXTRAS_AT_THE_TOP, every other one imported inside the if of
    # the block that uses it, where deleting the block deletes its use
    for script in scripts:
        tree = ast.parse((ROOT / script).read_text())
        top = {
            a.name
            for n in tree.body
            if isinstance(n, ast.ImportFrom)
            for a in n.names
            if n.module == "extras"
        }
        assert top <= EXTRAS_AT_THE_TOP, (script, top - EXTRAS_AT_THE_TOP)
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == "extras"
                and node not in tree.body
            ):
                block = parents[node]
                # or inside a plug point, which a user's own replaces (the demo data and models)
                plug_point = isinstance(block, ast.FunctionDef) and block.name in PLUG_POINTS
                assert isinstance(block, ast.If) or plug_point, (script, node.lineno)
    imports = {}
    for name, path in modules.items():
        assert len(path.read_text().splitlines()) <= 640, name
        found = [
            node
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom)
        ]
        # the core by its name, one sed renames it; the extras beside it relatively
        assert not [node.module for node in found if node.level == 0 and node.module == "extras"], (
            name
        )
        imports[name] = {node.module for node in found if node.level == 1}
        assert imports[name] <= EXTRAS_IMPORTING_EXTRAS.get(name, set()), (name, imports[name])
    # each module imports only modules before it in some order: no cycle
    order, left = set(), dict(imports)
    while left:
        ready = [name for name, needs in left.items() if needs <= order]
        assert ready, f"an import cycle among {sorted(left)}"
        order.update(ready)
        for name in ready:
            del left[name]
    for path in [ROOT / "utils.py", *modules.values(), *(ROOT / script for script in scripts)]:
        tree = ast.parse(path.read_text())
        assert not [
            node for node in ast.walk(tree) if isinstance(node, (ast.Global, ast.Nonlocal))
        ], path
        targets = [
            target
            for node in ast.walk(tree)
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
            for target in getattr(node, "targets", [getattr(node, "target", None)])
        ]
        # a module's name set from outside it: ours, or one in sys.modules
        assigned = [
            ast.unparse(target)
            for target in targets
            if isinstance(target, ast.Attribute)
            and isinstance(target.value, ast.Name)
            and target.value.id in {*modules, "utils", "sys"}
        ]
        assert not assigned, (path, assigned)


def test_each_script_holds_its_recipe():
    # DiLoCo's own statements over DDP's (its outer optimizer and step, its flags): 59; its replicas
    # gathered on rank 0 for a checkpoint (gather_on_rank_0, once extras/checkpoints.py's): 10
    assert code_lines(ROOT / "distributed_diloco.py") <= code_lines(ROOT / "distributed.py") + 69
    for script in [*CASES, "distributed_fsdp.py"]:
        source = (ROOT / script).read_text()
        # FSDP also owns its sharding units and its sharded checkpoints
        assert code_lines(ROOT / script) <= SCRIPT_LINES[script], script
        calls = [
            "DataLoader(",
            "def build_datasets(args)",
            "def build_model(args, num_classes",
            "def compute_loss(outputs, targets)",
            "def collate(samples",
            "from extras import builtin",
            "checks.returned_datasets(datasets)",
            "checks.returned_model(model",
            "StepRecords(",
            "recorder.add(",
            "clip_grad_norm_(",
            "IterableDataset)",
            "streams.StreamSampler(",
            "stalls.Watchdog(args.timeout, output_dir, rank",
            "watchdog.batch()",
            "\n        from extras import streams\n",
            "utils.steps_per_epoch(",
            "train_loader.sampler.set_epoch(epoch)",
            "averages.EMA(model, args.ema)",
            "ema.update()",
            "ema.evaluated(",
            "recorder.epoch(record)",
            "class Training:",
            "def train_one_epoch(run: Training, epoch: int, steps_done: int) -> dict:",
            "def train_step(run: Training, ",  # the step a user rewrites, beside the plug points
            # around each step, in plain lines: the watchdog, seeds, the stop, records, saves
            "utils.seed_step(args.seed, epoch, step)",
            "run.stop.agreed()",
            "recorder.train(epoch, step, run.model, run.optimizer, result",
            "validate(run, epoch, step)",
            "save_checkpoint(run, epoch, step)",
            "raise utils.Stopped(signum, epoch, step",
            "= train_step(run, ",
            "    optimizer.step()"
            if "fsdp" not in script and "amp" not in script
            else "scaler.step(optimizer)",
            "def save_checkpoint(run: Training, epoch: int, step: int",
        ]
        if script != "dataparallel.py":
            calls += [
                "init_process_group(",
                "DistributedSampler(",
                "range(rank, len(val_set), world_size)",
                "dist.broadcast(",
                "destroy_process_group()",
                "barrier()",
            ]
            # the collectives wait stalls.GRACE longer than --timeout: the watchdog speaks first
            assert stalls.GRACE == datetime.timedelta(seconds=30), stalls.GRACE
            calls += ["timeout=timeout + timedelta(seconds=30)"]
            calls += {
                "distributed_fsdp.py": ["fully_shard(", "dcp.save(", "dcp.load("],
                "distributed_diloco.py": ["DiLoCo(", "diloco.step("],
            }.get(script, ["DDP("])
        assert all(call in source for call in calls), (
            script,
            [c for c in calls if c not in source],
        )
        # streams only in the stream branches, as build_datasets reaches builtin
        assert "\nfrom extras import streams" not in source, script
        # the loop's state in one object: train_one_epoch and evaluate take at most 3 parameters,
        # main() defines no function of its own
        functions = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
        assert all(len(functions[f].args.args) <= 3 for f in ("train_one_epoch", "evaluate"))
        # the step a user rewrites beside the plug points, above the approach; distributed.py's
        # in under 20 lines
        assert source.index("def train_step(") < source.index("# ---- the approach ----"), script
        step = functions["train_step"]
        assert script != "distributed.py" or step.end_lineno - step.lineno < 20
        nested = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
        inside = [n for n in ast.walk(functions["main"]) if isinstance(n, nested)]
        assert inside == [functions["main"]], (script, [ast.unparse(n)[:60] for n in inside])


class Checkpointed(torch.nn.Module):
    """Two layers, recomputed in the backward where checkpointed (non-reentrant, as the scripts and Hugging Face
    checkpoint)."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        self.first, self.second, self.checkpointed = (
            torch.nn.Linear(16, 16),
            torch.nn.Linear(16, 3),
            checkpointed,
        )

    def layers(self, x):
        return self.second(torch.relu(self.first(x)))

    def forward(self, x):
        if self.checkpointed:
            return torch.utils.checkpoint.checkpoint(self.layers, x, use_reentrant=False)
        return self.layers(x)


def test_activation_checkpointing_leaves_the_start_up_steps_flops_as_they_are():
    """The start-up step counts model FLOPs: a checkpointed model's forward recomputed in the backward is not counted
    again (MFU must not rise when work is redone)."""
    inputs, targets = torch.randn(4, 16), torch.tensor([0, 1, 2, 0])
    counted = [
        start_up_step(
            torch.nn.Sequential(torch.nn.Linear(16, 16), Checkpointed(checkpointed)),
            inputs,
            targets,
            torch.nn.functional.cross_entropy,
        )[0]
        for checkpointed in (False, True)
    ]
    # each layer's forward and the gradients of its weights and (but the first's) its input
    assert counted[0] == counted[1] == 2 * (2 * 16 * 16) + 3 * (2 * 16 * 16) + 3 * (2 * 16 * 3), (
        counted
    )
