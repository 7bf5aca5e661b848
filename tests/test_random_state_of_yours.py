"""Random state the user's objects keep for themselves, and a sample drawn twice in an epoch: Albumentations 2.x
transforms (each Compose and transform holds its own NumPy and Python generators) and a Dataset's own NumPy
Generator are reseeded per sample from (seed, epoch, index), so 2 processes x 2 workers train what 1 process
without workers trains; a sampler with replacement draws a repeated index's transforms anew, still alike over
world sizes."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from processes import ends_every_rank_with, max_weight_difference, metrics, run, run_parallel
from projects import copy_with_your_functions, launch
from test_your_project import PREEMPTED
from extras import seeds

COMMON = ["--batch-size", "32", "--epochs", "2", "--lr", "0.05", "--timeout", "60"]

# 3x12x12 images around one centre per class (one array: nothing a worker's pickle holds many of), augmented by
# Albumentations as a segmentation or Kaggle pipeline does
YOUR_ALBUMENTATIONS = """
import albumentations as A
import numpy as np


class Augmented(torch.utils.data.Dataset):
    def __init__(self, size: int, seed: int):
        rng = np.random.default_rng(seed)
        centres = np.random.default_rng(0).normal(size=(4, 12, 12, 3)).astype(np.float32)
        self.labels = rng.integers(0, 4, size)
        self.images = (centres[self.labels] + rng.normal(size=(size, 12, 12, 3))).astype(np.float32)
        self.transform = A.Compose(
            [A.RandomResizedCrop(size=(8, 8), scale=(0.3, 1.0)), A.HorizontalFlip(), A.GaussNoise(p=0.5)]
        )

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = self.transform(image=self.images[index])["image"]
        return torch.from_numpy(image).permute(2, 0, 1).contiguous(), int(self.labels[index])


def build_datasets(args):
    return Augmented(320, 1), Augmented(101, 2), 4


def build_model(args, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(192, 32), nn.Tanh(), nn.Linear(32, num_classes))


def compute_loss(outputs, targets):
    return F.cross_entropy(outputs, targets)
"""

# a Dataset that adds noise from a NumPy Generator of its own, seeded once: every worker would unpickle the same
# state and step it on its own share
YOUR_OWN_GENERATOR = """
import numpy as np


class Noisy(torch.utils.data.Dataset):
    def __init__(self, size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        centres = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
        self.labels = torch.randint(0, 4, (size,), generator=generator)
        self.inputs = centres[self.labels]
        self.rng = np.random.default_rng(seed)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        noise = torch.from_numpy(self.rng.normal(size=(1, 8, 8)).astype("float32"))
        return self.inputs[index] + 1.5 * noise, int(self.labels[index])


def build_datasets(args):
    return Noisy(320, 1), Noisy(101, 2), 4


def build_model(args, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, num_classes))


def compute_loss(outputs, targets):
    return F.cross_entropy(outputs, targets)
"""
OWN_STATE = {"albumentations": YOUR_ALBUMENTATIONS, "its own NumPy Generator": YOUR_OWN_GENERATOR}


@pytest.mark.parametrize("case", OWN_STATE)
def test_random_state_a_dataset_keeps_for_itself_is_drawn_per_sample(case, tmp_path):
    """2 processes x 2 DataLoader workers train the weights of 1 process without workers (1e-5): each sample's
    draws come from (seed, epoch, index), whichever worker or rank reads it."""
    copy = copy_with_your_functions("distributed.py", tmp_path / "copy", OWN_STATE[case])
    one, two = tmp_path / "one", tmp_path / "two"
    run_parallel(
        [
            (launch(copy, 1, *COMMON, "--workers", "0", "--output-dir", one), {}, tmp_path),
            (launch(copy, 2, *COMMON, "--workers", "2", "--output-dir", two), {}, tmp_path),
        ]
    )
    assert max_weight_difference(one, two) <= 1e-5
    assert metrics(one)[-1]["val_acc"] > 0.5, metrics(one)  # it learns (chance is 0.25)


# random crops of a few images, drawn with replacement: indices repeat within an epoch; each read logs its index and
# its crop's fingerprint
YOUR_REPEATS = """
import os

from torchvision.transforms import v2 as T


class Crops(torch.utils.data.Dataset):
    def __init__(self, size: int, seed: int, log: str | None = None):
        generator = torch.Generator().manual_seed(seed)
        centres = torch.randn(4, 3, 12, 12, generator=torch.Generator().manual_seed(0))
        self.labels = torch.randint(0, 4, (size,), generator=generator)
        self.images = centres[self.labels] + torch.randn(size, 3, 12, 12, generator=generator)
        self.transform = T.Compose([T.RandomResizedCrop(8, scale=(0.3, 1.0), antialias=True), T.RandomHorizontalFlip()])
        self.log, self.epoch = log, None

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = self.transform(self.images[index])
        if self.log and self.epoch is not None:
            with open(f"{self.log}/crops-{os.environ.get('RANK', '0')}.txt", "a") as f:
                f.write(f"{self.epoch} {index} {image.sum().item()!r}\\n")
        return image, int(self.labels[index])


def build_datasets(args):
    os.makedirs(args.output_dir, exist_ok=True)
    return Crops(64, 1, args.output_dir), Crops(101, 2), 4


def build_model(args, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(192, 32), nn.Tanh(), nn.Linear(32, num_classes))


def compute_loss(outputs, targets):
    return F.cross_entropy(outputs, targets)


def build_sampler(args, train_set):
    return torch.utils.data.WeightedRandomSampler(torch.ones(64), 320, replacement=True)
"""


def crops(out: Path) -> dict[tuple[int, int], list[float]]:
    """Each (epoch, index) read in training, and the fingerprints of its crops, over all ranks."""
    read = defaultdict(list)
    for path in out.glob("crops-*.txt"):
        for line in path.read_text().splitlines():
            epoch, index, fingerprint = line.split()
            read[int(epoch), int(index)].append(float(fingerprint))
    return read


def test_an_index_drawn_twice_in_an_epoch_draws_its_crop_anew_on_any_number_of_processes(tmp_path):
    """A sampler with replacement (320 draws of 64 images): the repeats of an index get crops of their own (over 90 %
    of the draws distinct), as one process reading the stream would draw them; 2 processes read the same crops and train what 1 does (1e-5)."""
    copy = copy_with_your_functions("distributed.py", tmp_path / "copy", YOUR_REPEATS)
    one, two = tmp_path / "one", tmp_path / "two"
    run_parallel(
        [
            (launch(copy, 1, *COMMON, "--workers", "0", "--output-dir", one), {}, tmp_path),
            (launch(copy, 2, *COMMON, "--workers", "0", "--output-dir", two), {}, tmp_path),
        ]
    )
    read = crops(one)
    repeated = [sorted(prints) for prints in read.values() if len(prints) > 1]
    assert len(repeated) > 40  # most of the 64 images are drawn several times an epoch
    # each draw its own crop (a 12x12 image has few crop boxes: two draws may meet); keyed by the index alone, every
    # repeat would be the first draw's
    distinct = sum(len(set(prints)) for prints in repeated) / sum(
        len(prints) for prints in repeated
    )
    assert distinct > 0.9, distinct
    assert {key: sorted(prints) for key, prints in crops(two).items()} == {
        key: sorted(prints) for key, prints in read.items()
    }
    assert max_weight_difference(one, two) <= 1e-5


class Stage(torch.utils.data.Dataset):
    """A sample is a draw of torch's stream and the dataset's stage; set_epoch recorded."""

    def __init__(self):
        self.stage, self.epochs = 0, []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.rand(()).item(), self.stage


def test_the_seeded_dataset_keys_by_python_ints_passes_writes_on_and_reaches_set_epoch_under_subset_and_concat():
    """An index as a NumPy integer draws what the same Python int draws; a write to the wrapped dataset (a
    curriculum's stage) reaches it; set_epoch reaches datasets inside a Subset and a ConcatDataset."""
    inner, other = Stage(), Stage()
    wrapped = seeds.per_sample(
        torch.utils.data.ConcatDataset([torch.utils.data.Subset(inner, range(4)), other]), seed=0
    )
    assert wrapped[np.int64(5)] == wrapped[5] and wrapped[5] != wrapped[6]
    wrapped.set_epoch(3)
    assert inner.epochs == other.epochs == [3]
    plain = seeds.per_sample(Stage(), seed=0)
    plain.stage = 2
    assert plain[0][1] == 2 and plain.dataset.stage == 2


class Batched(torch.utils.data.Dataset):
    """Read in batches (__getitems__, each batch's indices recorded); with noise, each sample adds a draw from a NumPy
    Generator of its own."""

    def __init__(self, noise: bool):
        self.noise, self.rng, self.batches = noise, np.random.default_rng(0), []

    def __len__(self):
        return 8

    def __getitem__(self, index):
        return float(index) + (self.rng.normal() if self.noise else 0.0)

    def __getitems__(self, indices):
        self.batches.append(list(indices))
        return [self[index] for index in indices]


def test_a_batched_read_is_kept_where_the_samples_draw_nothing_and_each_sample_seeded_where_they_do():
    """A DataLoader over the seeded dataset reads a batch by the dataset's own __getitems__ where reading draws
    nothing (a Hugging Face Dataset's too); where it draws, a sample at a time from its seeds: a batch holds what the
    samples read alone hold."""
    plain = seeds.per_sample(Batched(noise=False), seed=0)
    assert [b.tolist() for b in torch.utils.data.DataLoader(plain, batch_size=4)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]
    assert plain.batched and plain.dataset.batches == [[0, 1, 2, 3], [4, 5, 6, 7]]
    noisy = seeds.per_sample(Batched(noise=True), seed=0)
    batches = [b.tolist() for b in torch.utils.data.DataLoader(noisy, batch_size=4)]
    assert not noisy.batched and noisy.dataset.batches == []
    assert batches == [[noisy[i] for i in range(4)], [noisy[i] for i in range(4, 8)]]
    assert (
        len({round(x - i, 6) for i, x in enumerate(batches[0] + batches[1])}) == 8
    )  # each its own draw
    rows = datasets.Dataset.from_dict({"x": list(range(8))}).with_format("torch")
    read = seeds.per_sample(rows, seed=0)
    assert (
        read.__getitems__([2, 5]) == [{"x": torch.tensor(2)}, {"x": torch.tensor(5)}]
        and read.batched
    )


# torchvision's CutMix in collate (it draws from torch's stream: the box and its size); the model sends its own
# process SIGTERM in its SIGTERM_AT_FORWARD-th training forward, as a scheduler's preemption
YOUR_CUTMIX = (
    """
import os
import signal

from torchvision.transforms import v2 as T

CUTMIX = T.CutMix(num_classes=4)


class Images(torch.utils.data.Dataset):
    def __init__(self, size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        centres = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
        self.labels = torch.randint(0, 4, (size,), generator=generator)
        self.images = centres[self.labels] + torch.randn(size, 3, 8, 8, generator=generator)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index], int(self.labels[index])


"""
    + PREEMPTED
    + """

def build_datasets(args):
    return Images(320, 1), Images(101, 2), 4


def build_model(args, num_classes):
    return Preempted(nn.Flatten(), nn.Linear(192, 32), nn.Tanh(), nn.Linear(32, num_classes))


def compute_loss(outputs, targets):
    return F.cross_entropy(outputs, targets)  # the mixed labels: a distribution over the classes


def collate(samples):
    return CUTMIX(*torch.utils.data.default_collate(samples))
"""
)


def test_a_collate_that_mixes_draws_alike_with_any_number_of_workers_and_when_continued(tmp_path):
    """CutMix in collate: 1 process trains the same weights with --workers 0 (the collate in the rank's own process,
    whose torch stream is the model's) and --workers 2 (in a worker, after its samples' draws); 2 processes
    stopped by SIGTERM mid-epoch and continued equal a straight run with workers (1e-6)."""
    copy = copy_with_your_functions("distributed.py", tmp_path / "copy", YOUR_CUTMIX)
    outs = {name: tmp_path / name for name in ("0 workers", "2 workers", "straight", "stopped")}
    flags = {
        "0 workers": (1, "0", {}),
        "2 workers": (1, "2", {}),
        "straight": (2, "2", {}),
        "stopped": (2, "0", {"SIGTERM_AT_FORWARD": str(1 + 10 + 3)}),  # in epoch 2
    }
    results = run_parallel(
        [
            (
                launch(copy, n, *COMMON, "--workers", workers, "--output-dir", outs[name]),
                env,
                tmp_path,
            )
            for name, (n, workers, env) in flags.items()
        ],
        check=False,
        at_once=2,
    )
    assert [r.returncode for r in results[:3]] == [0, 0, 0], [r.stderr[-2000:] for r in results[:3]]
    assert "stopped by SIGTERM after step" in results[3].stderr, results[3].stderr
    run(launch(copy, 2, *COMMON, "--workers", "0", "--output-dir", outs["stopped"]), cwd=tmp_path)
    assert max_weight_difference(outs["0 workers"], outs["2 workers"]) <= 1e-6
    assert max_weight_difference(outs["stopped"], outs["straight"]) <= 1e-6
    assert metrics(outs["straight"])[-1]["val_loss"] < 1.0, metrics(outs["straight"])  # it learns


# a model that weighs a block by a draw of Python's and NumPy's global streams (stochastic depth as some code writes
# it), over a Dataset that draws from the same streams as it reads
YOUR_PYTHON_RANDOM_MODEL = """
import random

import numpy as np


class Jittered(torch.utils.data.Dataset):
    def __init__(self, size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        centres = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
        self.labels = torch.randint(0, 4, (size,), generator=generator)
        self.inputs = centres[self.labels] + torch.randn(size, 1, 8, 8, generator=generator)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.inputs[index] * (0.9 + 0.2 * random.random()) + 0.1 * np.random.rand(), int(self.labels[index])


class RandomDepth(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.stem, self.block, self.head = nn.Linear(64, 32), nn.Linear(32, 32), nn.Linear(32, num_classes)

    def forward(self, x):
        h = torch.tanh(self.stem(x.flatten(1)))
        # the block's weight drawn for each step in training (its mean in evaluation)
        depth = 0.5
        if self.training:
            depth = random.random() * 0.9 + 0.1 * np.random.rand()
        return self.head(h + depth * torch.tanh(self.block(h)))


def build_datasets(args):
    return Jittered(320, 1), Jittered(101, 2), 4


def build_model(args, num_classes):
    return RandomDepth(num_classes)


def compute_loss(outputs, targets):
    return F.cross_entropy(outputs, targets)
"""


def test_the_models_python_and_numpy_draws_do_not_depend_on_where_the_samples_were_read(tmp_path):
    """Python's and NumPy's global streams, which the samples' reads seed, are the step's own again before its
    forward (as torch's is): a model drawing from them trains the same weights with --workers 0 (the samples read
    in the rank's own process) and --workers 2."""
    copy = copy_with_your_functions("distributed.py", tmp_path / "copy", YOUR_PYTHON_RANDOM_MODEL)
    outs = [tmp_path / "0", tmp_path / "2"]
    run_parallel(
        [
            (launch(copy, 1, *COMMON, "--workers", w, "--output-dir", out), {}, tmp_path)
            for w, out in zip("02", outs)
        ]
    )
    assert max_weight_difference(*outs) <= 1e-6


# a Dataset whose generator lives in a closure: no attribute holds it, so nothing can reseed it per sample
YOUR_HIDDEN_GENERATOR = YOUR_OWN_GENERATOR.replace(
    "        self.rng = np.random.default_rng(seed)",
    "        rng = np.random.default_rng(seed)\n        self.noise = lambda: rng.normal(size=(1, 8, 8))",
).replace("self.rng.normal(size=(1, 8, 8))", "self.noise()")


def test_random_state_the_scripts_cannot_reach_ends_every_rank_with_one_line(tmp_path):
    """A generator in a closure: sample 0 read twice from the same seeds differs, so the start-up check ends every
    rank with one line naming the Dataset, before training."""
    copy = copy_with_your_functions("distributed.py", tmp_path / "copy", YOUR_HIDDEN_GENERATOR)
    result = run(
        launch(copy, 2, *COMMON, "--workers", "0", "--output-dir", tmp_path / "out"),
        cwd=tmp_path,
        check=False,
    )
    ends_every_rank_with(
        result,
        "error: your Noisy reads sample 0 differently from the same seeds: it draws from a random state of its own"
        " that the scripts cannot reach, so ranks and workers would draw apart; keep its generator in an attribute"
        " (a NumPy Generator, a torch.Generator, a random.Random) or draw from torch's, Python's or NumPy's global"
        " streams",
        ranks=2,
    )
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
