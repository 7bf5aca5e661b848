"""Where each random draw comes from: the seed and where it is drawn, never which rank or worker
draws it. A sample's random transforms from (seed, epoch, index) (per_sample; a stream's from
its place, sample_streams), so that W processes with any number of workers train what one does;
randomness inside the model (dropout) from (seed, rank, epoch, step) (the core's seed_step): each
rank its own, as one process draws its own for each sample, and a continued run draws what a
straight one does; the generators a dataset keeps for itself reseeded per sample
(own_generators); a collate's draws from its batch's place (SeededCollate). A script enters it in
one block, which --no-sample-seeds leaves out.
"""

from __future__ import annotations

import contextlib
import collections
import itertools
import operator
import pickle
import random
import sys
import types

import torch
from torch.utils.data import ConcatDataset, Dataset, IterableDataset, Subset

from utils import derive, drawn_from


class SampleSeeds(Dataset):
    """A map-style Dataset whose every sample is read with its random streams seeded from (seed,
    epoch, index), and the generators the dataset keeps for itself (own_generators: Albumentations'
    and a NumPy Generator of its own) too: its random transforms (torchvision's, Albumentations',
    your own) do not depend on the rank, the worker, their numbers or what was read before. Other
    attributes are the dataset's own, read and written."""

    OWN = ("dataset", "seed", "epoch", "generators", "last_drawn", "batched")

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset = dataset
        self.seed = seed
        # In shared memory: persistent DataLoader workers read what set_epoch writes here.
        self.epoch = torch.zeros((), dtype=torch.long).share_memory_()
        # Found once; pickled with the dataset, they are still its own in a worker.
        self.generators = own_generators(dataset)
        # Its own batched read (__getitems__) where reading a sample draws nothing; found at the
        # first batch read, in the process or worker that reads it.
        self.batched = None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        return self.read(index)

    def read(self, index, repeat: int = 0):
        """The sample at index, drawn from (seed, epoch, index); its repeat-th draw in the epoch
        (a sampler with replacement) from (seed, epoch, index, repeat), so a repeat draws anew."""
        where = (int(self.epoch), operator.index(index))
        if repeat:
            where += (repeat,)
        with drawn_with(self.seed, *where, generators=self.generators):
            sample = self.dataset[index]
        # where the collate that follows in this process draws from (SeededCollate)
        self.last_drawn = where
        return sample

    def __getitems__(self, indices: list) -> list:
        """A batch's samples (the DataLoader's read of a batch): by the dataset's own batched read
        where its samples draw nothing (sample 0's read moved no stream nor generator of its own),
        else one at a time, each from its seeds."""
        if self.batched is None:
            self.batched = hasattr(self.dataset, "__getitems__") and not self.draws(0)
        if not self.batched:
            return [self.read(index) for index in indices]
        samples = self.dataset.__getitems__(indices)
        self.last_drawn = (int(self.epoch), operator.index(indices[-1]))
        return samples

    def read_again(self, index, repeat: int):
        """The sample at index drawn a repeat-th time in the epoch (samplers.Batches reads it)."""
        return self.read(index, repeat)

    def draws(self, index) -> bool:
        """Does reading the sample at index draw from a global stream or a generator the dataset
        keeps? (Read from its seeds: torch's stream, the model's, is given back.)"""
        with drawn_with(self.seed, "draws", generators=self.generators):
            before = stream_states(self.generators)
            self.dataset[index]
            return stream_states(self.generators) != before

    def __getattr__(self, name: str):
        # Dunder names stay ours: the dataset's __getitems__ is read through ours.
        if name.startswith("__") or name in self.OWN:
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __setattr__(self, name: str, value) -> None:
        # What a user's code sets (a curriculum's stage) reaches the dataset.
        if name in self.OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.dataset, name, value)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the samples' draws come from; passed on to the dataset's own set_epoch, and to
        the datasets' inside a Subset or a ConcatDataset."""
        self.epoch.fill_(epoch)
        for dataset in nested_datasets(self.dataset):
            if hasattr(dataset, "set_epoch"):
                dataset.set_epoch(epoch)


class SeededCollate:
    """A loader's collate whose draws (MixUp, CutMix) come from where its batch is: (seed, rank,
    the place of the last sample it collates), read in the same process just before. So they are
    alike with any number of DataLoader workers (in a worker, or in the rank's own process, whose
    torch stream is the model's) and in a continued run; over world sizes, where a global batch is
    split, alike in distribution. A dataset that does not say where it drew (a stream, the built-in
    images) leaves the collate as it is."""

    def __init__(self, collate, dataset: Dataset, seed: int, rank: int):
        self.collate = collate
        self.dataset = dataset
        self.seed = seed
        self.rank = rank

    def __call__(self, samples: list):
        last = getattr(self.dataset, "last_drawn", None)
        if last is None:
            return self.collate(samples)
        with drawn_from(self.seed, "collate", self.rank, *last):
            return self.collate(samples)


def nested_datasets(dataset: Dataset) -> list[Dataset]:
    """dataset, and those a Subset or a ConcatDataset (nested too) reads from."""
    found = [dataset]
    if isinstance(dataset, Subset):
        found += nested_datasets(dataset.dataset)
    if isinstance(dataset, ConcatDataset):
        for part in dataset.datasets:
            found += nested_datasets(part)
    return found


# Where own_generators does not look: what holds no generator, and what is too large to walk.
LEAVES = (str, bytes, int, float, bool, complex, type(None), torch.Tensor, types.ModuleType, type)
LONGEST = 10_000


def own_generators(obj) -> list:
    """The random generators obj keeps for itself, in its attributes, lists and dicts, nested:
    NumPy Generators and RandomStates, torch.Generators, random.Randoms (Albumentations' Compose
    and each of its transforms hold a NumPy and a Python one); each once, in one order."""
    numpy = sys.modules.get("numpy")
    kinds = (random.Random, torch.Generator)
    if numpy is not None:
        kinds += (numpy.random.Generator, numpy.random.RandomState)
    found, seen, todo = [], set(), collections.deque([obj])
    while todo:
        item = todo.popleft()
        if id(item) in seen or isinstance(item, LEAVES):
            continue
        # a builtin function or a bound method holds none (a closure's cells are not looked in)
        if callable(item) and not hasattr(item, "__dict__"):
            continue
        seen.add(id(item))
        if isinstance(item, kinds):
            found.append(item)
        elif numpy is not None and isinstance(item, numpy.ndarray):
            continue
        elif isinstance(item, dict):
            todo.extend(itertools.islice(item.values(), LONGEST))
        elif isinstance(item, (list, tuple, set, frozenset)):
            todo.extend(itertools.islice(item, LONGEST))
        elif hasattr(item, "__dict__"):
            todo.extend(vars(item).values())
    return found


def stream_states(generators: list) -> bytes:
    """The global streams' states and generators', as bytes: alike where nothing drew."""
    numpy = sys.modules.get("numpy")
    states = [torch.default_generator.get_state().numpy().tobytes(), random.getstate()]
    if numpy is not None:
        states.append(numpy.random.get_state())
    for generator in generators:
        if isinstance(generator, torch.Generator):
            states.append(generator.get_state().numpy().tobytes())
        elif isinstance(generator, random.Random):
            states.append(generator.getstate())
        elif isinstance(generator, numpy.random.RandomState):
            states.append(generator.get_state())
        else:  # a NumPy Generator
            states.append(generator.bit_generator.state)
    return pickle.dumps(states)


def per_sample(dataset: Dataset, seed: int) -> Dataset:
    """dataset read with each sample's random streams seeded from (seed, epoch, index); as it is
    where it seeds itself (seeds_itself = True: the built-in images draw from their index) or is a
    stream (StreamSampler seeds each sample from its place, sample_streams)."""
    if isinstance(dataset, IterableDataset) or getattr(dataset, "seeds_itself", False):
        return dataset
    return SampleSeeds(dataset, seed)


def sample_streams(reader, seed: int, *where):
    """reader's samples, each read (a stream applies its map as it yields) with its random streams
    and the generators it keeps for itself seeded from (seed, *where, its count): where the stream
    sampler names the reader and epoch."""
    generators = own_generators(reader)
    samples = iter(reader)
    count = 0
    while True:
        with drawn_with(seed, *where, count, generators=generators):
            sample = next(samples, samples)
        if sample is samples:
            return
        yield sample
        count += 1


def seed_generators(generators: list, seed: int) -> None:
    """Each generator reseeded in place from (seed, its place): whoever holds it draws anew."""
    numpy = sys.modules.get("numpy")
    for place, generator in enumerate(generators):
        own = derive(seed, place)
        if isinstance(generator, torch.Generator):
            generator.manual_seed(own)
        elif isinstance(generator, random.Random):
            generator.seed(own)
        elif isinstance(generator, numpy.random.Generator):
            bits = generator.bit_generator
            bits.state = type(bits)(own).state
        else:  # a NumPy RandomState
            generator.seed(own % 2**32)


@contextlib.contextmanager
def drawn_with(seed: int, *where, generators: list = ()):
    """utils.drawn_from, and the generators a dataset keeps for itself reseeded from the same
    place."""
    with drawn_from(seed, *where):
        if generators:
            seed_generators(generators, derive(seed, "own", *where))
        yield
