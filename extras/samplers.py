"""A user's own sampler (build_sampler) drawn as one process draws it, on any number of ranks:
each epoch's stream of indices, or of global batches, drawn alike on every rank from (seed,
epoch) however the sampler draws (its torch.Generator, torch's, Python's or NumPy's global
stream), and each rank's share of every global batch (DrawnShares). Lightning's and Catalyst's
DistributedSamplerWrapper instead draw on each rank and take every W-th index of the draw, so the
global batches are not one process's and the ranks agree only if their streams happen to.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import operator

import torch
from torch.utils.data import Dataset, IterableDataset, Sampler

from utils import UsageError, all_gather_objects, derive, drawn_from


class DrawnShares(Sampler):
    """This rank's share of a user's sampler, drawn whole from (seed, epoch) on every rank: a list
    of (index, repeat) for each global batch, repeat how often the epoch drew the index before,
    which a loader over Batches(dataset) reads as one batch.

    A sampler of indices (WeightedRandomSampler, SubsetRandomSampler, a class-balanced sampler):
    its stream is cut into global batches of batch_size (full ones, micro_batches of them a step
    under accumulation). A batch sampler (length buckets, a token budget): each of its batches is a
    global batch of any size. Rank r takes items r, r + W, ... of each, as GlobalBatchShares does.
    Where the sampler has set_epoch it is told the epoch first."""

    def __init__(
        self,
        sampler,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        micro_batches: int = 1,
    ):
        self.sampler = sampler
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.micro_batches = micro_batches
        self.epoch = 0
        self.drawn = None  # (epoch, its global batches)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def draw(self, epoch: int) -> list:
        """The sampler's whole stream for epoch: every rank draws the same from (seed, epoch); the
        model's random stream (dropout) is left as it was."""
        with drawn_from(self.seed, "sampler", epoch):
            generator = getattr(self.sampler, "generator", None)
            if isinstance(generator, torch.Generator):
                generator.manual_seed(derive(self.seed, "sampler generator", epoch))
            if hasattr(self.sampler, "set_epoch"):
                self.sampler.set_epoch(epoch)
            return [indices_of(item) for item in self.sampler]

    def global_batches(self) -> list[list[int]]:
        """This epoch's global batches, drawn once an epoch: a batch sampler's, or cut from a
        sampler's stream of indices."""
        if self.drawn is not None and self.drawn[0] == self.epoch:
            return self.drawn[1]
        stream = self.draw(self.epoch)
        name = type(self.sampler).__name__
        if stream and isinstance(stream[0], list):
            batches = stream
            small = min(len(batch) for batch in batches)
            if small < self.world_size:
                raise UsageError(
                    f"build_sampler's {name} gave a batch of {small} samples in epoch"
                    f" {self.epoch + 1}, fewer than the {self.world_size} processes: make every"
                    " batch at least that large"
                )
        else:
            full = len(stream) // self.batch_size * self.batch_size
            batches = [
                stream[start : start + self.batch_size] for start in range(0, full, self.batch_size)
            ]
        # full steps only: micro_batches of them a step
        batches = batches[: len(batches) // self.micro_batches * self.micro_batches]
        if not batches:
            raise UsageError(
                f"build_sampler's {name} draws {len(stream)} samples, not one batch of"
                f" {self.batch_size * self.micro_batches}: draw more or give a smaller --batch-size"
            )
        self.drawn = (self.epoch, batches)
        return batches

    def __iter__(self):
        # each index with how often the epoch drew it before (a sampler with replacement), so that
        # a repeat draws its random transforms anew, alike on any number of ranks
        drawn = collections.Counter()
        for batch in self.global_batches():
            repeats = []
            for index in batch:
                repeats.append((index, drawn[index]))
                drawn[index] += 1
            yield repeats[self.rank :: self.world_size]

    def __len__(self) -> int:
        return len(self.global_batches())

    def samples_in_step(self, step: int) -> int:
        """All ranks' samples in step's batch (1-based; its micro-batches'): a batch sampler's
        batches differ in size."""
        first = (step - 1) * self.micro_batches
        return sum(
            len(batch) for batch in self.global_batches()[first : first + self.micro_batches]
        )

    def check_drawn_alike(self) -> None:
        """Every rank calls it (an all-gather): epoch 1's stream drawn again here, and on every
        rank, must be the same, or the sampler keeps a random state that --seed does not reach
        (its own NumPy Generator, a generator seeded from the clock or the rank): one line."""
        digests = [digest(self.draw(0)) for _ in range(2)]
        everyone = all_gather_objects(digests)
        if any(d != everyone[0][0] for ranks_digests in everyone for d in ranks_digests):
            name = type(self.sampler).__name__
            raise UsageError(
                f"build_sampler's {name} draws another stream each time or on each rank from the"
                " same --seed: it keeps a random state of its own; let it draw from a"
                " torch.Generator given as its generator (seeded here each epoch) or from torch's"
                " global stream"
            )


def check_not_a_stream(sampler, train_set) -> None:
    """A stream has no indices to sample: one line where build_sampler returned a sampler for
    one."""
    if sampler is not None and isinstance(train_set, IterableDataset):
        raise UsageError(
            f"build_sampler returned a {type(sampler).__name__}, but the training set is a stream"
            " (an IterableDataset), which has no indices to sample: return None, or a map-style"
            " Dataset"
        )


class Batches(Dataset):
    """A dataset read a list of (index, repeat) at a time: this rank's share of a global batch,
    which the loader's collate makes one batch; a sample drawn again in the epoch is read as its
    repeat (seeds.SampleSeeds.read_again). Other attributes are the dataset's own."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, drawn: list) -> list:
        return [self.read(index, repeat) for index, repeat in drawn]

    def read(self, index: int, repeat: int):
        # a sampler over another set's length: one line, not the dataset's IndexError mid-epoch
        if not 0 <= index < len(self.dataset):
            raise UsageError(
                f"build_sampler drew index {index}, outside the training set's"
                f" {len(self.dataset)} samples: draw from range(len(train_set))"
            )
        # a repeat read anew where the samples draw from their place (seeds.SampleSeeds)
        if repeat and hasattr(self.dataset, "read_again"):
            return self.dataset.read_again(index, repeat)
        return self.dataset[index]

    def first_drawn(self, shares, n: int) -> list:
        """The first n samples of shares, lists of (index, repeat)."""
        drawn = itertools.chain.from_iterable(shares)
        return [self.read(index, repeat) for index, repeat in itertools.islice(drawn, n)]

    def __getattr__(self, name: str):
        # Dunder names stay ours; "dataset" is not yet set while a worker unpickles this.
        if name.startswith("__") or name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


def indices_of(item) -> int | list[int]:
    """A sampler's item as a Python int (an index: int, NumPy integer, a tensor of one) or a list
    of them (a batch)."""
    try:
        return operator.index(item)
    except TypeError:
        pass
    if isinstance(item, torch.Tensor) and item.dim() == 0:
        return int(item)
    try:
        return [operator.index(i) if not isinstance(i, torch.Tensor) else int(i) for i in item]
    except TypeError:
        raise UsageError(
            f"build_sampler's sampler gave {type(item).__name__} {item!r:.40}: give indices of the"
            " training set, or lists of them (a batch sampler)"
        ) from None


def digest(stream: list) -> str:
    return hashlib.blake2b(repr(stream).encode(), digest_size=16).hexdigest()
