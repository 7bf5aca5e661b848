"""What a project brings beyond data and model (build_sampler, build_metrics, --keep-best), driven as a user drives
the scripts: their own sampler (a WeightedRandomSampler, a length-bucketing batch sampler) trains on any number of
processes what one process does, continued too; their torchmetrics count every validation sample once (checked
against scikit-learn on the saved model); the best validation's weights are kept, and kept across a continuation."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from torchmetrics.classification import MulticlassF1Score

from processes import (
    OFFLINE,
    assert_wandb_equals_the_records,
    ends_every_rank_with,
    max_weight_difference,
    metrics,
    run,
    run_parallel,
    steps,
)
from test_records import assert_tensorboard_equals_the_records
from projects import COMMON, YOUR_CLASSIFICATION, copy_with_your_functions, launch, users_code

# a model that sends its own process SIGTERM in its SIGTERM_AT_FORWARD-th training forward, as a scheduler's
# preemption (the user's code imports os and signal)
PREEMPTED = """
class Preempted(nn.Sequential):
    forwards = 0

    def forward(self, x):
        self.forwards += self.training
        if self.forwards == int(os.environ.get("SIGTERM_AT_FORWARD", 0)):
            os.kill(os.getpid(), signal.SIGTERM)
        return super().forward(x)
"""

# A 4-class set whose class 3 is rare (8 %), a sampler that draws it five times as often, without a generator of
# its own (it draws from torch's global stream), and a Dataset that writes which index each rank reads in each
# epoch. SIGTERM_AT_FORWARD: the model sends its own process SIGTERM in that training forward (a preemption).
YOUR_IMBALANCED = (
    '''
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


'''
    + PREEMPTED
    + """

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
"""
)
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
    SIGTERM in epoch 2 and continued ends as the straight one (1e-6), and continued on 3 processes as well (1e-5)."""
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

    # preempted in epoch 2 (forward 1 is the start-up check's) on 2 processes, continued with the same command on 2,
    # and on 3
    stopped = {n: tmp_path / f"stopped-{n}" for n in (2, 3)}
    preempted = run_parallel(
        [
            (
                launch(copy, 2, *SAMPLED, "--output-dir", out),
                {"SIGTERM_AT_FORWARD": str(1 + 10 + 4)},
                tmp_path,
            )
            for out in stopped.values()
        ],
        check=False,
    )
    for result, out in zip(preempted, stopped.values()):
        assert result.returncode != 0 and "stopped by SIGTERM after step" in result.stderr, (
            result.stderr
        )
        state = torch.load(out / "checkpoint.pt", weights_only=True)
        assert state["epoch"] == 1 and 0 < state["step"] < 10, (
            state["epoch"],
            state["step"],
        )  # mid-epoch 2
    run_parallel(
        [
            (launch(copy, n, *SAMPLED, "--output-dir", out), {}, tmp_path)
            for n, out in stopped.items()
        ]
    )
    assert max_weight_difference(stopped[2], outs[2]) <= 1e-6
    assert [m["val_loss"] for m in metrics(stopped[2])] == pytest.approx(
        [m["val_loss"] for m in metrics(outs[2])], abs=1e-6
    )
    assert max_weight_difference(stopped[3], outs[1]) <= 1e-5


def rare_share(epochs: dict[int, Counter]) -> float:
    """The rare class's share of the draws, its labels made as the user's Dataset makes them."""
    labels = users_code(YOUR_IMBALANCED)["Imbalanced"](640, seed=1).labels
    drawn = sum((c for c in epochs.values()), Counter())
    return sum(k for i, k in drawn.items() if labels[i] == 3) / sum(drawn.values())


# Token sequences of 4 to 16 tokens, each token's class its id mod 4 (padding: target -100), batched by a sampler
# that buckets similar lengths under a budget of 160 padded tokens, so its batches differ in size (10 to 40
# sequences); the loss is a (sum, count) over the real tokens. It draws from torch's global stream.
YOUR_LENGTH_BUCKETS = '''
import os


class Sequences(torch.utils.data.Dataset):
    def __init__(self, size: int, seed: int, log: str | None = None):
        generator = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(4, 17, (size,), generator=generator).tolist()
        self.tokens = [torch.randint(1, 17, (n,), generator=generator) for n in self.lengths]
        self.log, self.epoch = log, None

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        if self.log and self.epoch is not None:  # training's reads (not the start-up check's)
            with open(f"{self.log}/draws-{os.environ.get('RANK', '0')}.txt", "a") as f:
                f.write(f"{self.epoch} {index}\\n")
        tokens = self.tokens[index]
        return tokens, tokens % 4


class TokenBudget(torch.utils.data.Sampler):
    """Batches of similar lengths, at most `budget` padded tokens each: shuffled, sorted by length within chunks of
    64, cut greedily, the batches shuffled."""

    def __init__(self, lengths, budget=160):
        self.lengths, self.budget = lengths, budget

    def __iter__(self):
        order = torch.randperm(len(self.lengths)).tolist()
        batches = []
        for start in range(0, len(order), 64):
            batch = []
            for index in sorted(order[start : start + 64], key=self.lengths.__getitem__):
                if batch and (len(batch) + 1) * self.lengths[index] > self.budget:
                    batches.append(batch)
                    batch = []
                batch.append(index)
            batches.append(batch)
        for i in torch.randperm(len(batches)).tolist():
            yield batches[i]


class Tagger(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.embed, self.head = nn.Embedding(17, 16), nn.Linear(16, num_classes)

    def forward(self, tokens):
        return self.head(torch.tanh(self.embed(tokens))).transpose(1, 2)  # scores at dim 1: (batch, classes, length)


def build_datasets(args):
    os.makedirs(args.output_dir, exist_ok=True)
    return Sequences(480, seed=1, log=args.output_dir), Sequences(101, seed=2), 4


def build_model(args, num_classes):
    return Tagger(num_classes)


def compute_loss(outputs, targets):
    loss = F.cross_entropy(outputs, targets, ignore_index=-100, reduction="sum")
    return loss, (targets != -100).sum()


def collate(samples):
    tokens = nn.utils.rnn.pad_sequence([s[0] for s in samples], batch_first=True)
    targets = nn.utils.rnn.pad_sequence([s[1] for s in samples], batch_first=True, padding_value=-100)
    return tokens, targets


def build_sampler(args, train_set):
    return TokenBudget(train_set.lengths)
'''
BUCKETED = [
    "--epochs",
    "2",
    "--lr",
    "0.5",
    "--workers",
    "0",
    "--timeout",
    "60",
    "--batch-size",
    "32",
]
# (script, its flags): each on 2 processes trains the weights of dataparallel.py in one process (grad_accum: two of the
# sampler's batches a step, as in one process with the same flag)
BUCKET_CASES = {
    "distributed.py": [],
    "distributed_mp.py": [],
    "distributed_fsdp.py": [],
    "distributed_diloco.py": ["--inner-steps", "1", "--outer-lr", "1", "--outer-momentum", "0"],
    "distributed_grad_accum.py": ["--accum-steps", "2"],
    "distributed_amp.py": ["--amp-dtype", "bfloat16"],
}


@pytest.fixture(scope="module")
def bucketed_reference(tmp_path_factory) -> Path:
    """The length-bucketed tagger trained by dataparallel.py, one process."""
    base = tmp_path_factory.mktemp("bucketed")
    copy = copy_with_your_functions("dataparallel.py", base / "copy", YOUR_LENGTH_BUCKETS)
    run(launch(copy, 1, *BUCKETED, "--output-dir", base / "out"), cwd=base)
    return base / "out"


@pytest.mark.parametrize("script", BUCKET_CASES)
def test_a_length_bucketing_batch_sampler_trains_on_two_processes_what_one_does(
    script, tmp_path, bucketed_reference
):
    """Batches of 10 to 40 sequences, each rank its share of every one, the (sum, count) loss over all ranks' tokens:
    the weights of one process (1e-5); under autocast in bfloat16, a model that learns as much."""
    flags = BUCKET_CASES[script]
    copy = copy_with_your_functions(script, tmp_path / "copy", YOUR_LENGTH_BUCKETS)
    out, reference = tmp_path / "two", bucketed_reference
    commands = [(launch(copy, 2, *BUCKETED, *flags, "--output-dir", out), {}, tmp_path)]
    if script == "distributed_grad_accum.py":  # its reference takes two batches a step too
        reference = tmp_path / "one"
        commands.append(
            (launch(copy, 1, *BUCKETED, *flags, "--output-dir", reference), {}, tmp_path)
        )
    run_parallel(commands)
    records = metrics(out)
    assert records[-1]["val_acc"] > 0.9, records  # the tokens' classes are learned (chance is 0.25)
    assert [m["val_images"] for m in records] == [101, 101]
    if script == "distributed_amp.py":
        assert records[-1]["val_loss"] == pytest.approx(
            metrics(reference)[-1]["val_loss"], abs=0.05
        )
        return
    assert max_weight_difference(out, reference) <= 1e-5
    assert draws(out) == draws(reference)  # each sequence of each batch read once, by one rank
    # the batch sampler's steps: about 480 sequences of 4 to 16 tokens over 160-token batches
    assert 14 <= steps_of(out) <= 40, steps_of(out)


def steps_of(out: Path) -> int:
    """The run's optimizer steps an epoch, from its last validation record."""
    return [r for r in steps(out) if "val_loss" in r][-1]["step"]


# Six classes (so top-5 accuracy applies), a noisy set a small MLP cannot score perfectly, and torchmetrics' macro F1
# and AUROC; VAL_SIZE: how many validation samples (203 by default, an odd count over 2 and 3 ranks).
YOUR_METRICS = (
    YOUR_CLASSIFICATION.replace("centres = torch.randn(4,", "centres = 0.5 * torch.randn(6,")
    .replace("torch.randint(0, 4, (size,)", "torch.randint(0, 6, (size,)")
    .replace(
        "return Blobs(640, seed=1), Blobs(203, seed=2), 4",
        'return Blobs(640, seed=1), Blobs(int(os.environ.get("VAL_SIZE", 203)), seed=2), 6',
    )
    + """

import os

from torchmetrics.classification import MulticlassAUROC, MulticlassF1Score


def build_metrics(args, num_classes):
    return {
        "f1": MulticlassF1Score(num_classes, average="macro"),
        "auroc": MulticlassAUROC(num_classes),
    }
"""
)
SINKS = ["--tensorboard", "--wandb", "ddp-scripts-tests"]
MEASURED_BY = [
    "--batch-size",
    "64",
    "--epochs",
    "2",
    "--lr",
    "0.05",
    "--workers",
    "0",
    "--timeout",
    "60",
]


def predictions(yours: str, weights: dict, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, labels) of the user's model with weights over their validation set, in this process."""
    code = users_code(yours)
    model = code["build_model"](None, 6)
    model.load_state_dict(weights)
    data = code["Blobs"](size, seed=2)
    with torch.no_grad():
        return model(data.inputs).softmax(1), data.labels


def test_torchmetrics_count_every_validation_sample_once_on_any_number_of_processes(tmp_path):
    """Macro F1 and AUROC (no sums over ranks: AUROC keeps every score) of the saved weights and of their average
    equal scikit-learn's over the whole set of 203 on 1, 2 and 3 processes, FSDP's too (whose ranks join a
    forward with a spare batch); top-5 accuracy beside top-1; one validation sample on 2 processes (a rank with
    none) is one process's."""
    from sklearn.metrics import f1_score, roc_auc_score

    copies = {
        s: copy_with_your_functions(s, tmp_path / s, YOUR_METRICS)
        for s in ("distributed.py", "distributed_fsdp.py")
    }
    # (script, processes, environment, flags of its own)
    cases = {
        "1": (copies["distributed.py"], 1, {}, []),
        "2": (copies["distributed.py"], 2, OFFLINE, SINKS),  # and TensorBoard and W&B
        "3": (copies["distributed.py"], 3, {}, []),
        "fsdp": (copies["distributed_fsdp.py"], 3, {}, []),
        "one sample": (copies["distributed.py"], 2, {"VAL_SIZE": "1"}, []),
    }
    outs = {name: tmp_path / name.replace(" ", "-") for name in cases}
    every = [*MEASURED_BY, "--ema", "0.5", "--eval-every", "4"]
    run_parallel(
        [
            (launch(copy, n, *every, *flags, "--output-dir", outs[name]), env, tmp_path)
            for name, (copy, n, env, flags) in cases.items()
        ],
        at_once=2,
    )
    for name, out in outs.items():
        size = 1 if name == "one sample" else 203
        last = metrics(out)[-1]
        assert last["val_images"] == size
        for suffix, path in (
            ("", "model.pt" if name == "fsdp" else "checkpoint.pt"),
            ("_ema", "model_ema.pt"),
        ):
            state = torch.load(out / path, weights_only=True)
            scores, labels = predictions(YOUR_METRICS, state.get("model", state), size)
            if size == 1:  # what torchmetrics gives in one process
                f1 = MulticlassF1Score(6, average="macro")(scores, labels).item()
            else:
                f1 = f1_score(labels, scores.argmax(1), average="macro")
                auroc = roc_auc_score(labels, scores, multi_class="ovr", average="macro")
                assert last[f"val_auroc{suffix}"] == pytest.approx(auroc, abs=1e-4), (name, suffix)
                top5 = (
                    (scores.topk(5, dim=1).indices == labels.unsqueeze(1))
                    .any(1)
                    .double()
                    .mean()
                    .item()
                )
                assert last[f"val_acc5{suffix}"] == pytest.approx(top5, abs=1e-6), (name, suffix)
            assert last[f"val_f1{suffix}"] == pytest.approx(f1, abs=1e-6), (name, suffix, last)
        # mid-epoch validations record them too
        assert all("val_f1" in r and "val_auroc_ema" in r for r in steps(out) if "val_loss" in r)
    # TensorBoard and W&B got every record, val_f1 and val_auroc too
    assert_tensorboard_equals_the_records(outs["2"])
    assert_wandb_equals_the_records(outs["2"], runs=1)
    # neither chance (1/6) nor perfect: a real test of the order of the scores
    assert 0.3 < metrics(outs["3"])[-1]["val_f1"] < 0.95


# 64 training samples of which a third have a random label, a wide MLP and a high learning rate: validation loss
# falls, then rises as the model learns the noise.
YOUR_OVERFIT = (
    YOUR_CLASSIFICATION.replace(
        "return Blobs(640, seed=1), Blobs(203, seed=2), 4",
        "return Noisy(64, seed=1), Blobs(203, seed=2), 4",
    ).replace(
        "return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, num_classes))",
        "return nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, num_classes))",
    )
    + """

class Noisy(Blobs):
    def __init__(self, size, seed):
        super().__init__(size, seed)
        noise = torch.Generator().manual_seed(seed + 1)
        flipped = torch.rand(size, generator=noise) < 0.35
        self.labels = torch.where(flipped, torch.randint(0, 4, (size,), generator=noise), self.labels)
"""
)
OVERFIT = [
    "--batch-size",
    "16",
    "--epochs",
    "12",
    "--lr",
    "0.02",
    "--workers",
    "0",
    "--timeout",
    "60",
]


def validation_loss(yours: str, weights: dict) -> float:
    """The user's loss of weights over their validation set, in this process."""
    code = users_code(yours)
    model = code["build_model"](None, 4)
    model.load_state_dict(weights)
    data = code["Blobs"](203, seed=2)
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(data.inputs), data.labels).item()


def test_keep_best_keeps_the_best_validations_weights_and_a_continued_run_the_same(tmp_path):
    """A run that overfits (validation loss lowest in epoch 3 of 12): model_best.pt holds the weights whose loss is
    that lowest val_loss, which its record and line name; a run stopped after epoch 5 and continued ends with the
    same model_best.pt. FSDP keeps the best of the average's (val_loss_ema) gathered, with plain keys."""
    ddp = copy_with_your_functions("distributed.py", tmp_path / "ddp", YOUR_OVERFIT)
    fsdp = copy_with_your_functions("distributed_fsdp.py", tmp_path / "fsdp", YOUR_OVERFIT)
    straight, stopped, averaged = tmp_path / "straight", tmp_path / "stopped", tmp_path / "averaged"
    best = ["--keep-best", "val_loss"]
    results = run_parallel(
        [
            (launch(ddp, 2, *OVERFIT, *best, "--output-dir", straight), {}, tmp_path),
            (
                launch(ddp, 2, *OVERFIT, *best, "--stop-after", "5", "--output-dir", stopped),
                {},
                tmp_path,
            ),
            (
                launch(
                    fsdp,
                    2,
                    *OVERFIT,
                    "--ema",
                    "0.5",
                    "--keep-best",
                    "val_loss_ema",
                    "--output-dir",
                    averaged,
                ),
                {},
                tmp_path,
            ),
        ],
        at_once=2,
    )
    records = metrics(straight)
    losses = [r["val_loss"] for r in records]
    lowest = losses.index(min(losses))
    assert 1 <= lowest <= 4 and losses[-1] > min(losses) + 0.05, (
        losses
    )  # it overfits after a few epochs
    assert [r.get("new_best") for r in records[lowest:]] == ["val_loss"] + [None] * (
        len(records) - lowest - 1
    )
    kept = torch.load(straight / "model_best.pt", weights_only=True)
    assert validation_loss(YOUR_OVERFIT, kept) == pytest.approx(min(losses), abs=1e-5)
    assert "val_acc_ema" not in records[0] and re.search(
        rf"^epoch {lowest + 1}/12 .* img/s, the best val_loss so far: model_best.pt",
        results[0].stdout,
        re.M,
    ), results[0].stdout

    # continued after epoch 5: the best of epochs 1 to 5 stays the best
    assert [r["epoch"] for r in metrics(stopped)] == [1, 2, 3, 4, 5]
    run(launch(ddp, 2, *OVERFIT, *best, "--output-dir", stopped), cwd=tmp_path)
    again = torch.load(stopped / "model_best.pt", weights_only=True)
    assert max((again[k] - kept[k]).abs().max().item() for k in kept) <= 1e-6
    assert [r.get("new_best") for r in metrics(stopped)] == [r.get("new_best") for r in records]

    # FSDP, the average's best: gathered, plain keys
    averages = [r["val_loss_ema"] for r in metrics(averaged)]
    kept = torch.load(averaged / "model_best.pt", weights_only=True)
    assert list(kept) == ["1.weight", "1.bias", "3.weight", "3.bias"]
    assert validation_loss(YOUR_OVERFIT, kept) == pytest.approx(min(averages), abs=1e-5)


# A sampler that draws from a NumPy Generator of its own, seeded from nothing the run knows: its ranks would read
# different samples (the old worker-seeding trap, on the ranks).
ITS_OWN_GENERATOR = """

import numpy as np


class OwnDraws(torch.utils.data.Sampler):
    def __init__(self, size):
        self.size, self.rng = size, np.random.default_rng()

    def __iter__(self):
        return iter(self.rng.permutation(self.size).tolist())

    def __len__(self):
        return self.size


def build_sampler(args, train_set):
    return OwnDraws(len(train_set))
"""
A_STREAM_WITH_A_SAMPLER = (
    YOUR_CLASSIFICATION.replace(
        "return Blobs(640, seed=1), Blobs(203, seed=2), 4", "return Stream(), Blobs(203, seed=2), 4"
    )
    + """

class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from Blobs(640, seed=1)


def build_sampler(args, train_set):
    return torch.utils.data.RandomSampler(range(640))
"""
)
# a step of one's own that calls loss.backward(), not run.backward(loss): right only where the ranks' parts are equal
A_STEP_WITH_ITS_OWN_BACKWARD = (
    YOUR_CLASSIFICATION
    + """

def train_step(run, inputs, targets):
    outputs = run.model(inputs)
    loss = compute_loss(outputs, targets)
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    run.optimizer.step()
    run.scheduler.step()
    return dict(loss=loss, outputs=outputs)
"""
)
ONE_LINE_CASES = {
    "its own generator": (
        YOUR_CLASSIFICATION + ITS_OWN_GENERATOR,
        [],
        "error: build_sampler's OwnDraws draws another stream each time or on each rank from the same --seed: it"
        " keeps a random state of its own; let it draw from a torch.Generator given as its generator (seeded here"
        " each epoch) or from torch's global stream",
    ),
    "a stream": (
        A_STREAM_WITH_A_SAMPLER,
        ["--steps-per-epoch", "5"],
        "error: build_sampler returned a RandomSampler, but the training set is a stream (an IterableDataset), which"
        " has no indices to sample: return None, or a map-style Dataset",
    ),
    "its own backward": (
        A_STEP_WITH_ITS_OWN_BACKWARD,
        [],
        "error: train_step did not call run.backward(): a plain loss.backward() is wrong where the ranks' parts of a"
        " batch differ",
    ),
    "an unknown name": (
        YOUR_METRICS,
        ["--keep-best", "val_f1_ema"],
        "error: --keep-best val_f1_ema: no validation records it; it records val_loss, val_acc, val_acc5, val_f1,"
        " val_auroc",
    ),
}


@pytest.mark.parametrize("case", ONE_LINE_CASES)
def test_what_cannot_be_kept_exact_ends_every_rank_with_one_line(case, tmp_path):
    """A sampler with a random state of its own, a sampler for a stream, a --keep-best name that no validation
    records (an _ema one without --ema): one line on each rank before training, no traceback; a train_step that
    calls loss.backward() (a gradient wrong where the ranks' parts differ): one line at its first step."""
    yours, flags, line = ONE_LINE_CASES[case]
    copy = copy_with_your_functions("distributed.py", tmp_path / "copy", yours)
    result = run(
        launch(copy, 2, *COMMON, *flags, "--output-dir", tmp_path / "out"),
        cwd=tmp_path,
        check=False,
    )
    ends_every_rank_with(result, line, ranks=2)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_a_sampler_past_the_set_and_a_metric_that_is_no_metric_are_one_line_each():
    """Found by trying a user's slips by hand: a sampler over another set's length ended a rank in the dataset's
    IndexError (at the start-up check or mid-epoch), and a plain function among build_metrics' values in an
    AttributeError. Each is a UsageError, which the scripts say in one line on every rank (a batch read in a worker
    too: stops.next_batch)."""
    from extras import samplers, scores

    points = torch.utils.data.TensorDataset(torch.randn(4, 8))
    assert samplers.Batches(points)[[(3, 0)]][0][0].shape == (8,)
    with pytest.raises(samplers.UsageError) as error:
        samplers.Batches(points)[[(0, 0), (9, 0)]]
    assert str(error.value) == (
        "build_sampler drew index 9, outside the training set's 4 samples: draw from range(len(train_set))"
    )
    with pytest.raises(scores.UsageError) as error:
        scores.UserMetrics({"f1": lambda outputs, targets: 0.5}, torch.device("cpu"))
    assert str(error.value) == (
        "build_metrics' 'f1' is a function: give a torchmetrics Metric, which counts every validation sample once"
        " over all ranks"
    )
