"""Streams (an IterableDataset: a Hugging Face streaming dataset, a webdataset pipeline, your own):
read in each rank's main process as global batches, so that any number of processes and DataLoader
workers trains the same model, and every sample of an epoch is trained on once.

A script imports it in its stream branch only, as build_datasets imports builtin.
"""

from __future__ import annotations

from collections.abc import Callable
import bisect
import hashlib
import itertools
import math
import pickle

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, IterableDataset

from utils import UsageError, all_gather_objects, all_reduce, first_line, share, tree_map_only


class StreamSampler:
    """A stream read as global batches, each of the next size / V samples of V fixed readers (V of
    its shards where it has them). Each rank gets its share of each global batch, a contiguous
    run of it (in micro_batches of its share of batch_size under accumulation; shares within one
    sample of each other, as ranks.share gives them), as lists of samples that a DataLoader worker
    collates.

    Each rank reads only the readers its share overlaps. Once one reader has ended (shards of
    different sizes), the rest of every reader, still read by one rank alone, goes to every rank,
    and global batches are cut from it: every sample of an epoch is trained on once.
    """

    def __init__(
        self,
        stream: IterableDataset,
        batch_size: int,
        rank: int,
        world_size: int,
        train: bool = True,
        micro_batches: int = 1,
        seed: int = 0,
        seeded: Callable | None = None,
    ):
        self.stream = stream
        self.seed = seed
        # seeds.sample_streams: each sample's random streams from its place (without it, the
        # stream's own)
        self.seeded = seeded
        self.part = share(batch_size, rank, world_size)  # a micro-batch of this rank
        self.rank = rank
        self.train = train
        self.micro_batches = micro_batches
        self.share = self.part * micro_batches  # this rank's samples in an optimizer step
        self.size = batch_size * micro_batches  # a global batch
        # where each rank's share of a global batch starts (the last: its end)
        parts = [share(batch_size, r, world_size) * micro_batches for r in range(world_size)]
        self.starts = [0, *itertools.accumulate(parts)]
        self.start = self.starts[rank]
        self.epoch = 0
        shards = 1
        if hasattr(stream, "shard"):
            shards = getattr(stream, "n_shards", 1)
        # Training: readers of equally many shards that divide the global batch, whatever the number
        # of processes. Validation (every sample once, no batch to keep alike): a reader a rank
        # where the shards split so, else the whole stream.
        if train:
            self.readers = math.gcd(self.size, shards)
        elif shards % world_size == 0:
            self.readers = world_size
            # each rank its own reader, a share at a time
            self.size = self.part * world_size
            self.start = rank * self.part
        else:
            self.readers = 1
        # The ranks learn of a reader that ended, and share the rest, in a group of their own (gloo:
        # the samples are CPU objects).
        self.group = None
        if train and self.readers > 1 and world_size > 1:
            self.group = dist.new_group(backend="gloo")

    def set_epoch(self, epoch: int) -> None:
        """A new order each epoch: passed on to the stream's own set_epoch."""
        self.epoch = epoch

    def __len__(self) -> int:
        """Batches (micro-batches); a TypeError for a stream without __len__."""
        if self.train:
            return len(self.stream) // self.size * self.micro_batches
        return ceil_div(len(self.stream), self.size)

    def reader(self, index: int):
        """The stream's index-th part of self.readers, at this epoch; each sample's random streams
        (the stream's map, which runs as it yields) seeded from (seed, epoch, index, the sample's
        count in it), places that do not depend on the number of processes."""
        reader = self.stream
        if self.readers > 1:
            reader = self.stream.shard(self.readers, index)
        if hasattr(reader, "set_epoch"):
            reader.set_epoch(self.epoch)
        if self.seeded is None or getattr(self.stream, "seeds_itself", False):
            return reader
        return self.seeded(reader, self.seed, "stream", self.epoch, index)

    def __iter__(self):
        # Each reader's samples in a global batch, and the readers this rank's share overlaps.
        chunk = self.size // self.readers
        first = self.start // chunk
        end = ceil_div(self.start + self.share, chunk)
        readers = {index: iter(self.reader(index)) for index in range(first, end)}
        start = self.start - first * chunk
        while True:
            chunks = {
                index: list(itertools.islice(reader, chunk)) for index, reader in readers.items()
            }
            # On every rank: no reader of any rank has ended.
            full = self.all_full(all(len(c) == chunk for c in chunks.values()))
            samples = [sample for c in chunks.values() for sample in c][start : start + self.share]
            # Validation keeps an incomplete last batch too.
            if full or (samples and not self.train):
                yield from self.split_into_micro_batches(samples)
            if not full:
                break
        if not self.train:
            return
        # Training goes on with the rest of every reader; an incomplete last global batch is
        # dropped.
        rest = self.rest(readers, chunks, chunk)
        while True:
            batch = list(itertools.islice(rest, self.size))
            if len(batch) < self.size:
                return
            mine = batch[self.start : self.start + self.share]
            yield from self.split_into_micro_batches(mine)

    def split_into_micro_batches(self, samples: list):
        for i in range(0, len(samples), self.part):
            yield samples[i : i + self.part]

    def all_full(self, full: bool) -> bool:
        """Has every rank read a full chunk of each of its readers? (A collective.)"""
        if self.group is None:
            return full
        flag = all_reduce(torch.tensor([int(full)]), dist.ReduceOp.MIN, self.group)
        return bool(flag)

    def rest(self, readers: dict, chunks: dict, chunk: int):
        """The samples after the first reader ended, alike on every rank: from each reader that has
        more, in reader order, its next chunk, in turns. Each reader is read by the first rank that
        reads it, which sends the turn's chunks to all (a collective a turn): each sample is still
        read once."""
        # The readers this rank sends: those whose first sample is in its share.
        mine = {
            index: c
            for index, c in chunks.items()
            if bisect.bisect_right(self.starts, index * chunk) - 1 == self.rank
        }
        while True:
            parts = [mine]
            if self.group is not None:
                parts = all_gather_objects(mine, self.group)
            turn = {}
            for part in parts:
                turn.update(part)
            for index in sorted(turn):
                yield from turn[index]
            if not any(len(c) == chunk for c in turn.values()):
                return  # every reader has ended
            mine = {
                index: list(itertools.islice(readers[index], chunk))
                for index, c in mine.items()
                if len(c) == chunk
            }

    def first(self, n: int) -> list:
        """The first reader's first n samples, alike on every rank (a collective), or else the
        stream splits itself: one line."""
        try:
            samples = list(itertools.islice(self.reader(0), n))
        except ValueError as e:
            # webdataset's default node splitter refuses a second process; any other is the user's.
            if "nodesplitter" not in str(e):
                raise
            message = f"the stream cannot be read ({first_line(e)}): give every process all of it"
            raise UsageError(message) from None
        # Tensors compared by value: their pickles differ between processes. Samples no worker could
        # take either go unchecked.
        try:
            as_lists = tree_map_only(torch.Tensor, torch.Tensor.tolist, samples)
            digest = hashlib.sha256(pickle.dumps(as_lists)).digest()
        except (pickle.PicklingError, TypeError, AttributeError):
            digest = b""
        if len(set(all_gather_objects(digest))) > 1:
            raise UsageError(
                "the stream gives the processes different first samples: it must give every process"
                " all of it, in the same order (no split_dataset_by_node, no webdataset"
                " split_by_node): the script splits it"
            )
        return samples


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Samples(Dataset):
    """A StreamSampler's "index" is its list of samples: the worker collates it as it is."""

    def __getitem__(self, samples: list) -> list:
        return samples
