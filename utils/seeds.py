"""Where each random draw comes from: the seed and where it is drawn, never which rank or worker
draws it. A sample's random transforms from (seed, epoch, index) (per_sample; a stream's from
its place, sample_streams), so that W processes with any number of workers train what one does;
randomness inside the model (dropout) from (seed, rank, epoch, step) (seed_step): each rank its own,
as one process draws its own for each sample, and a continued run draws what a straight one does;
the loaders' workers from (seed, rank) (loader_generator).
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import sys

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, IterableDataset, get_worker_info


def derive(*keys) -> int:
    """A seed of 63 bits from keys (whole numbers or strings): far apart for keys that differ by
    one, as torch, random and NumPy each want."""
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def seed_data_streams(seed: int) -> None:
    """torch's, Python's and (where imported) NumPy's global random streams, from seed."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


@contextlib.contextmanager
def drawn_from(seed: int, *where):
    """with drawn_from(seed, *where): the block's draws come from (seed, *where) alone. In a rank's
    own process (no DataLoader worker) torch's stream is given back afterwards: it is the model's
    (dropout)."""
    kept = None
    if get_worker_info() is None:
        kept = torch.default_generator.get_state()
    seed_data_streams(derive(seed, *where))
    try:
        yield
    finally:
        if kept is not None:
            torch.default_generator.set_state(kept)


class SampleSeeds(Dataset):
    """A map-style Dataset whose every sample is read with its random streams seeded from (seed,
    epoch, index): its random transforms (torchvision's, Albumentations', your own) do not depend
    on the rank, the worker, their numbers or what was read before. Other attributes are the
    dataset's own."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset = dataset
        self.seed = seed
        # In shared memory: persistent DataLoader workers read what set_epoch writes here.
        self.epoch = torch.zeros((), dtype=torch.long).share_memory_()

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        with drawn_from(self.seed, int(self.epoch), index):
            return self.dataset[index]

    def __getattr__(self, name: str):
        # Dunder names stay ours: a __getitems__ of the dataset would read unseeded.
        if name.startswith("__") or name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the samples' draws come from; passed on to the dataset's own set_epoch."""
        self.epoch.fill_(epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)


def per_sample(dataset: Dataset, seed: int) -> Dataset:
    """dataset read with each sample's random streams seeded from (seed, epoch, index); as it is
    where it seeds itself (seeds_itself = True: the built-in images draw from their index) or is a
    stream (StreamSampler seeds each sample from its place, sample_streams)."""
    if isinstance(dataset, IterableDataset) or getattr(dataset, "seeds_itself", False):
        return dataset
    return SampleSeeds(dataset, seed)


def sample_streams(reader, seed: int, *where):
    """reader's samples, each read (a stream applies its map as it yields) with its random streams
    seeded from (seed, *where, its count): where the stream sampler names the reader and epoch."""
    samples = iter(reader)
    count = 0
    while True:
        with drawn_from(seed, *where, count):
            sample = next(samples, samples)
        if sample is samples:
            return
        yield sample
        count += 1


def seed_step(seed: int, epoch: int, step: int) -> None:
    """Before a step's forward: this rank's own random streams inside the model (dropout,
    stochastic depth), on the CPU and every GPU (DataParallel's replicas each their own), from
    (seed, rank, epoch, step), so that ranks draw independently and a run continued at any step
    draws what a straight one does. No GPU work: a generator's seed is set on the host."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    step_seed = derive(seed, "model", rank, epoch, step)
    torch.default_generator.manual_seed(step_seed)
    if torch.cuda.is_initialized():
        for device, generator in enumerate(torch.cuda.default_generators):
            generator.manual_seed(derive(step_seed, device))


def loader_generator(seed: int, rank: int) -> torch.Generator:
    """A DataLoader's generator from (seed, rank): its workers' base seed changes with --seed and
    differs between ranks (what a collate draws); the global stream stays the model's."""
    return torch.Generator().manual_seed(derive(seed, "workers", rank))
