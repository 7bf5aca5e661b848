"""Runs on any number of processes, and torchrun's restarts and elastic joins.

- GlobalBatchShares: a global batch that the ranks do not divide (3 processes, batch 64; an
  elastic run continued on another world size), each rank's share within one sample of the
  others'. A script uses it where the batch does not divide; without it, give a batch that does.
- fresh_namespace: torchrun keeps one store for the job, across restarts of its workers, whose
  count differs between nodes (PyTorch issue 135712): each new process group gets a part of it
  that no earlier group wrote to. A script uses it under torchrun (TORCHELASTIC_USE_AGENT_STORE);
  without it a restart on one node alone may meet a stale group."""

from __future__ import annotations

import datetime
import time
import uuid

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

from utils import share


def fresh_namespace(
    store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta
) -> dist.Store:
    """A part of store no earlier group of this job wrote to: rank 0 draws a generation and
    answers each rank's token with it."""
    # The whole store, not the part of one restart count (utils.rendezvous_store's), which
    # differs between nodes.
    store = getattr(store, "underlying_store", store)
    if rank != 0:
        token = uuid.uuid4().hex
        store.set(f"ddp/hello/{rank}", token)
        generation = int(store.get(f"ddp/answer/{token}"))  # waits for rank 0's answer
        store.add(f"ddp/{generation}/joined", 1)
        return dist.PrefixStore(f"ddp/{generation}/", store)
    deadline = time.monotonic() + timeout.total_seconds()
    generation = store.add("ddp/generation", 1)
    answered = set()
    hellos = [f"ddp/hello/{r}" for r in range(1, world_size)]
    while True:
        joined = store.add(f"ddp/{generation}/joined", 0)
        if joined >= world_size - 1:
            return dist.PrefixStore(f"ddp/{generation}/", store)
        arrived = [key for key in hellos if store.check([key])]
        for token in set(store.multi_get(arrived)) - answered:
            store.set(f"ddp/answer/{token.decode()}", str(generation))
            answered.add(token)
        if time.monotonic() > deadline:
            arrived = f"only {joined + 1} of {world_size} processes arrived within {timeout}"
            raise TimeoutError(arrived)
        time.sleep(0.01)


class GlobalBatchShares(DistributedSampler):
    """DistributedSampler for a global batch that the ranks do not divide: one shuffle per epoch,
    alike on every rank (set_epoch), cut into global batches of batch_size (micro_batches of them a
    step under accumulation); rank r takes samples r, r + W, ... of each, its share within one
    sample of the others' (utils.share). Full steps only. Where the batch divides, its samples are
    DistributedSampler's with drop_last."""

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int = 0,
        micro_batches: int = 1,
    ):
        super().__init__(dataset, world_size, rank, shuffle=True, seed=seed)
        self.batch_size = batch_size
        self.batches = len(dataset) // (batch_size * micro_batches) * micro_batches
        self.num_samples = self.batches * share(batch_size, rank, world_size)

    def __iter__(self):
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.dataset), generator=generator).tolist()
        for start in range(0, self.batches * self.batch_size, self.batch_size):
            yield from order[start + self.rank : start + self.batch_size : self.num_replicas]
