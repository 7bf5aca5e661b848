"""The core every script imports: what makes any run right, in one file of torch and the standard
library. Top to bottom:

- the ranks: joining the process group on loopback unless told otherwise (init_method,
  rendezvous_store), which rank prints (setup_logging), collectives that also work in a world of
  one, and errors_shared_by_all_ranks, a block that every rank enters and that ends every rank
  with one rank's error;
- a batch of any task: each rank's part of a global batch (share, split_batch), on the device,
  forwarded, its loss weighted so that W processes train what one does (loss_for_backward); the
  validation's shares, every sample once (ValidationShares);
- the stop every rank agrees on (StopSignal: SIGTERM, SIGUSR1, --save-minutes); the stall
  watchdog's stand-in where --no-watchdog leaves extras/stalls.py out (NoWatchdog);
- every random draw from the seed and where it is drawn; files written whole; the optimizer and
  its schedule (build_optimizer, warmup_cosine);
- the flags every script shares (build_parser, check_args), DDP's own (add_ddp_flags);
- errors: UsageError, and run_main, which ends every error of ours or a library's in one line.

Every other guarantee is an extra, a module of extras/ that a script imports where it uses it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import errno
import functools
import gc
import hashlib
import importlib
import inspect
import itertools
import json
import logging
import math
import os
import random
import re
import signal
import socket
import sys
import sysconfig
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

# Nested tuples, lists and dicts of tensors, mapped and flattened: PyTorch's own tree utilities,
# which torch.compile and FSDP use too (a private module: tests/test_internals.py).
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten  # noqa: F401

# PyTorch 2.8 or newer: on an older one a gloo process group could hang at exit (PyTorch PR
# 154976), and a listening socket failed the tcp:// store. 2.8.0a0 (a container's build) is 2.8.
if tuple(map(int, torch.__version__.split(".")[:2])) < (2, 8):
    raise SystemExit(
        f"error: the scripts need PyTorch 2.8 or newer, not {torch.__version__}: pip install -r"
        " requirements.txt"
    )


# ---- the ranks: the process group, which rank prints, collectives ----

log = logging.getLogger("train")


def setup_logging(rank: int) -> None:
    """Rank 0 prints progress; the other ranks print warnings and errors only."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        stream=sys.stdout,
        force=True,
        format="%(message)s" if rank == 0 else f"[rank {rank}] %(message)s",
    )


def from_environment(args) -> tuple[int, int, int]:
    """(rank, local rank, world size) as torchrun, torch.distributed.launch (--local-rank) or
    Slurm's srun (extras/slurm.py) sets them; (0, 0, 1) without them: a world of one. A local
    rank without a GPU of its own is refused in one line."""
    env = os.environ
    rank, world_size = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    local_rank = int(env.get("LOCAL_RANK", args.local_rank))
    if torch.cuda.is_available() and local_rank >= torch.cuda.device_count():
        raise UsageError(
            f"local rank {local_rank}, but this node has {torch.cuda.device_count()} GPUs: start"
            " one process per GPU"
        )
    return rank, local_rank, world_size


def set_cpu_threads(local_world_size: int) -> None:
    """Processes that share a machine's cores must not each use all of them."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))


def init_method(args) -> str | None:
    """Where the ranks meet: --dist-url; tcp:// from --ip and --port (loopback and 29500 unless
    given); env:// under torchrun, torch.distributed.launch and Slurm; None for a plain `python
    script.py`, a world of one."""
    if args.dist_url:
        return args.dist_url
    if args.ip or args.port:
        return f"tcp://{args.ip or '127.0.0.1'}:{args.port or 29500}"
    if "MASTER_ADDR" in os.environ:
        return "env://"
    return None


@contextlib.contextmanager
def init_errors_as_one_line(address: str | None):
    """A failed rendezvous at address (init_method's; None: a store of this process's own) as a
    line that says what to change."""
    where = address or "local store"
    try:
        yield
    except (dist.DistError, RuntimeError, ValueError, OSError) as e:
        text = first_line(e)
        timed_out = re.search("timed out|timeout", text, re.I) is not None
        if isinstance(e, (dist.DistStoreError, TimeoutError)) or timed_out:
            raise UsageError(
                f"rendezvous at {where} timed out: is the address right and every process"
                f" started? ({text})"
            ) from None
        raise UsageError(f"rendezvous at {where} failed: {text}") from None


def rendezvous_store(
    init_method: str | None, rank: int, world_size: int, timeout: datetime.timedelta
) -> dist.Store:
    """The key-value store where the processes meet, for init_process_group(store=...)."""
    if init_method is None:
        return dist.HashStore()  # a world of one needs no network
    url = urlparse(init_method)
    if url.scheme == "file":
        return dist.FileStore(url.path, world_size)
    if url.scheme == "env":
        if not {"MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
            raise UsageError(
                "--dist-url env:// reads MASTER_ADDR and MASTER_PORT, which are not set: start"
                " with torchrun, or give tcp://HOST:PORT"
            )
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun hosts the store
            agent_store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
            # each restart of torchrun's workers a part of it, by its count, as PyTorch's env://
            # (extras/elastic.py: also where nodes restart unequally)
            restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            return dist.PrefixStore(f"ddp/restart{restarts}/", agent_store)
        url = urlparse(f"tcp://{host}:{port}")  # Slurm, or MASTER_ADDR set by hand
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        raise UsageError(f"--dist-url {init_method}: give env://, tcp://HOST:PORT or file:///PATH")
    # Rank 0 listens on the given address only: TCPStore alone would listen on every interface.
    listen_fd = None
    if rank == 0:
        try:
            listen_fd = socket.create_server((url.hostname, url.port)).detach()
        except OSError as e:
            # strerror without Python's "(while attempting to bind on address ...)": said below
            cause = (e.strerror or str(e)).split(" (while attempting")[0]
            reason = f"{cause}; rank 0 listens there: --ip or --dist-url must be its node's address"
            if e.errno == errno.EADDRINUSE:
                reason = "the port is in use; choose another --port"
            where = f"tcp://{url.hostname}:{url.port}"
            raise UsageError(f"cannot listen on {where}: {reason}") from None
    # A client retries while rank 0 is not yet listening, and PyTorch logs each retry with a C++
    # stack (TORCH_CPP_LOG_LEVEL, read at start-up only, would mute every C++ warning of the
    # process): standard error set aside while it connects; a failure is one line, said after.
    with stderr_set_aside() if rank != 0 else contextlib.nullcontext():
        return dist.TCPStore(
            url.hostname,
            url.port,
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            master_listen_fd=listen_fd,
        )


@contextlib.contextmanager
def stderr_set_aside():
    """File descriptor 2 on /dev/null for the block (what C++ writes there too), then back."""
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def no_buffer_sync_per_forward() -> dict[str, bool]:
    """DDP's keyword for no buffer broadcast before every forward (forward_sync_buffers since
    2.14)."""
    params = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    if "forward_sync_buffers" in params:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """Every rank calls it: tensor, in place, summed (or op) over all ranks; as it is in a world
    of one."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def world_size() -> int:
    """The processes of the run: 1 without a process group."""
    return dist.get_world_size() if dist.is_initialized() else 1


@functools.cache
def cpu_group() -> dist.ProcessGroup | None:
    """The group that CPU tensors cross in: all ranks over gloo, made at the first call (every
    rank's, at the same place) where the run's own group is NCCL's; None (the run's own) on gloo."""
    return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def rank() -> int:
    """This process's place in the run: 0 without a process group."""
    return dist.get_rank() if dist.is_initialized() else 0


def local_ranks() -> int:
    """The processes of the run on this node (torchrun's LOCAL_WORLD_SIZE; all of them without
    it)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))


def all_gather_objects(obj, group=None) -> list:
    """Every rank calls it: every rank's obj, in rank order; [obj] in a world of one."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    objects = [None] * dist.get_world_size(group)
    dist.all_gather_object(objects, obj, group=group)
    return objects


def check_gloo_averages(world_size: int) -> None:
    """FSDP averages the gradients with reduce_scatter(AVG), which PyTorch 2.8's gloo sums: one
    line there, where CPU processes would train W times the gradient. Every rank calls it."""
    average = torch.zeros(1)
    dist.reduce_scatter_tensor(average, torch.ones(world_size), op=dist.ReduceOp.AVG)
    if average.item() != 1:
        raise UsageError(
            f"PyTorch {torch.__version__}'s gloo sums where FSDP averages, so CPU processes"
            " would train wrong: use a newer PyTorch (2.15 is tested)"
        )


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside DDP, DataParallel and torch.compile wrappers (models trained
    together, extras/together.py: the ModuleDict as built)."""
    inner = getattr(model, "module", getattr(model, "_orig_mod", None))
    return model if inner is None else unwrap(inner)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: its shard of an FSDP parameter (a DTensor), else the tensor
    itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@contextlib.contextmanager
def errors_shared_by_all_ranks():
    """Every rank enters this block (an all-gather at its exit): its OSError (a full disk) or
    UsageError on any rank ends every rank with that one line. A block for rank 0 alone is an
    `if rank == 0:` inside it."""
    error = ""
    try:
        yield
    except UsageError as e:
        error = str(e)
    except OSError as e:
        # A failed write() names no file: then the directory it was in.
        where = e.filename or "in --output-dir"
        error = f"cannot write {where}: {e.strerror or e}: free space or use another --output-dir"
    errors = [e for e in all_gather_objects(error) if e]
    if errors:
        raise UsageError(errors[0])


# ---- any batch of any task: counted, on the device, forwarded, weighted; each rank's part ----


def share(batch_size: int, rank: int, parts: int) -> int:
    """Rank's part of a batch split over parts: its samples rank, rank + parts, ..., so that the
    parts differ by at most one sample."""
    return len(range(rank, batch_size, parts))


def split_batch(batch_size: int, parts: int, what: str) -> str:
    """How a batch splits over parts (described by what), as the first line says it: "2 x 32", or
    "3 x 21-22" where it does not divide; a clear error if some part would be empty."""
    if batch_size < parts:
        raise UsageError(
            f"--batch-size {batch_size} is smaller than {what}: give each at least one sample"
        )
    low, high = batch_size // parts, share(batch_size, 0, parts)
    if low == high:
        return f"{parts} x {low}"
    return f"{parts} x {low}-{high}"


class Counted:
    """Counted(collate): a collate_fn giving (samples, batch), any batch counted as its samples
    (pickled to the workers with the collate it holds). What a library refuses in collate
    (default_collate: samples of two sizes) is one line at the user's line, at the start-up check
    or mid-epoch, in a worker or not (errors.refused_as_one_line); an error collate raises itself
    is the user's."""

    def __init__(self, collate: Callable[[list], object]):
        self.collate = collate

    def __call__(self, samples: list) -> tuple[int, object]:
        with refused_as_one_line("collate cannot batch its samples", then="; pad them"):
            return len(samples), self.collate(samples)


def forward(model: nn.Module, inputs):
    """A dict of inputs as keyword arguments, as Hugging Face models take them; anything else as
    one argument."""
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(inputs)


def loss_for_backward(loss, samples: int, batch_size: int):
    """The loss whose backward gives this rank's share of the whole batch's gradient. DDP and FSDP
    average the W ranks' gradients, so a rank's mean loss counts as if it held batch_size / W
    samples; where it holds `samples`, it is weighted by samples x W / batch_size (1 where the
    ranks' parts are equal: the loss as it is). A (sum, count) loss is sum x W / all ranks' count
    (one small all-reduce, every rank): the exact mean over every item of the step."""
    if isinstance(loss, torch.Tensor):
        weight = samples * world_size() / batch_size
        if weight == 1:
            return loss
        return loss * weight
    total, count = loss
    count = all_reduce(count_to_device(count, total.device))
    return total * (world_size() / count.clamp(min=1)).to(total.dtype)


def logits(outputs):
    """The scores in outputs: themselves, or the logits of a dict or a Hugging Face ModelOutput."""
    if isinstance(outputs, Mapping):
        return outputs.get("logits")
    return getattr(outputs, "logits", outputs)


def class_indices(outputs, targets) -> bool:
    """Are targets class indices for scores at outputs' dim 1 (classification, per-pixel
    classification)?"""
    if not (isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor)):
        return False
    whole_numbers = not (
        targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool
    )
    one_score_each = outputs.shape[:1] + outputs.shape[2:] == targets.shape
    return (
        outputs.is_floating_point()
        and whole_numbers
        and outputs.dim() == targets.dim() + 1
        and one_score_each
    )


def batch_to_device(
    batch,
    device: torch.device,
    dataset: Dataset,
    channels_last: bool = False,
    key: tuple[int, int] | None = None,
):
    """(inputs, targets) of any structure on the device. A dataset with a batch_transform(inputs,
    key) has it finish the inputs there, key (epoch, step) for a training batch and None for a
    validation one: the built-in images' fast path (builtin); a user's Dataset has none."""
    inputs, targets = batch
    if isinstance(inputs, torch.Tensor) and isinstance(targets, torch.Tensor):
        inputs, targets = to_device(inputs, device), to_device(targets, device)
    else:
        # A tokenizer's BatchEncoding goes in as a plain dict.
        if isinstance(inputs, Mapping):
            inputs = dict(inputs)
        inputs, targets = tree_map_only(
            torch.Tensor, functools.partial(to_device, device=device), (inputs, targets)
        )
    transform = getattr(dataset, "batch_transform", None)
    if transform is not None:
        inputs = transform(inputs, key)
    if channels_last and isinstance(inputs, torch.Tensor) and inputs.dim() == 4:
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    return inputs, targets


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """tensor on device, the host not waiting for the copy: to a GPU from pinned memory (the
    DataLoader's pin_memory pins a batch already; a tensor made on the host is pinned here)."""
    if device.type == "cuda" and not tensor.is_cuda and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def count_to_device(count, device: torch.device) -> torch.Tensor:
    """A count (a Python number, or a tensor anywhere) as a new float64 tensor on device, copied
    without a wait."""
    if isinstance(count, torch.Tensor):
        return count.to(device, torch.float64, non_blocking=True, copy=True)
    return to_device(torch.tensor(count, dtype=torch.float64), device)


def steps_per_epoch(loader: DataLoader, args, micro_batches: int = 1) -> int:
    """Optimizer steps in an epoch: the loader's full batches, cut at --steps-per-epoch (which a
    stream without __len__ needs)."""
    try:
        batches = len(loader) // micro_batches
    except TypeError as e:
        # A TypeError in the stream's own __len__ is the user's error.
        if not raised_in(e, *OURS):
            raise
        # A stream without __len__: an epoch is one pass, cut at N steps.
        if not args.steps_per_epoch:
            raise UsageError(
                "the training set is a stream without __len__: give --steps-per-epoch N, the "
                "optimizer steps of an epoch"
            ) from None
        batches = args.steps_per_epoch
    return min(batches, args.steps_per_epoch or batches)


def epoch_loader(loader: DataLoader, epoch: int, skip: int) -> DataLoader:
    """The loader for this epoch (call its sampler's set_epoch first): a dataset with set_epoch is
    told the epoch (the built-in image folder draws its crops from it); continued mid-epoch,
    without its first skip batches."""
    if hasattr(loader.dataset, "set_epoch"):
        loader.dataset.set_epoch(epoch)
    if not skip:
        return loader
    # The indices after them in this epoch's order; a stream's batches are read again, not
    # collated.
    rest = itertools.islice(loader.sampler, skip * (loader.batch_size or 1), None)
    return DataLoader(
        loader.dataset,
        loader.batch_size,
        sampler=rest,
        drop_last=loader.drop_last,
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        generator=loader.generator,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
    )


def first_samples(loader: DataLoader, n: int) -> list:
    """The first n samples of this rank's loader (a stream's first): for the start-up step, or a
    spare batch."""
    # A stream's sampler (streams.StreamSampler) reads them from the stream.
    if hasattr(loader.sampler, "first"):
        return loader.sampler.first(n)
    # A share of nothing (a validation sampler with no index) takes the first of the set.
    indices = loader.sampler or range(len(loader.dataset))
    # A user's sampler's shares are lists of (index, repeat), which samplers.Batches reads.
    if hasattr(loader.dataset, "first_drawn"):
        return loader.dataset.first_drawn(indices, n)
    return [loader.dataset[i] for i in itertools.islice(indices, n)]


def samples_in_step(sampler, step: int, batch_size: int) -> int:
    """All ranks' samples in step's batch: --batch-size, or what a user's batch sampler drew
    (samplers.DrawnShares says)."""
    return sampler.samples_in_step(step) if hasattr(sampler, "samples_in_step") else batch_size


class ValidationShares(Sampler):
    """Validation's batches of this rank's samples (indices: range(rank, len(val_set), W), every
    sample once): its share of each global batch of batch_size in the set's order, so that a loss
    over the whole batch (batches.whole_batch) sees one process's batches. A last batch of fewer
    samples than ranks joins the one before it: every rank has the same number of batches (but
    for a set of fewer samples than ranks)."""

    def __init__(self, indices: range, batch_size: int):
        self.indices = indices
        self.starts = list(range(0, indices.stop, batch_size))
        if len(self.starts) > 1 and indices.stop - self.starts[-1] < indices.step:
            self.starts.pop()

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __iter__(self):
        first, end, step = self.indices.start, self.indices.stop, self.indices.step
        for start, stop in zip(self.starts, [*self.starts[1:], end]):
            share = list(range(start + (first - start) % step, stop, step))
            if share:  # a set of fewer samples than ranks: none for the last ranks
                yield share


# ---- the stop every rank agrees on ----


class StopSignal:
    """Notes SIGTERM and SIGUSR1 (preemption, Slurm's --signal) instead of dying at once; all ranks
    agree on the step to stop after, and, given save_minutes, on a step to save after each time
    that many minutes have passed on any rank's clock."""

    def __init__(self, save_minutes: float | None = None):
        self.signal = 0
        self.work = None
        # The step's flags (signal, lacking a batch, save timer, a failed write), all-reduced in
        # place to what every rank agreed on: one tensor, made once, each step's numbers written
        # and read through its NumPy view (a torch.tensor of a list each step cost about 25 us of
        # the step's CPU time).
        self.flags = torch.zeros(4, dtype=torch.long)
        self.saves = None
        self.values = self.flags.numpy()
        self.save_seconds = (save_minutes or 0) * 60
        self.saved_at = time.monotonic()
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(signum, self.note)
        # A world of one agrees with itself: no collective.
        self.alone = world_size() == 1
        # With GPUs the flags go over the CPU: no GPU synchronisation every step.
        self.group = None if self.alone else cpu_group()

    def watch(self, saves) -> None:
        """A checkpoint write that failed in the background (checkpoints.Saves: rank 0's files,
        FSDP's shards on every rank) ends every rank with its line at the next step."""
        self.saves = saves

    def note(self, signum: int, frame) -> None:
        self.signal = signum

    def agreed(self) -> tuple[int, bool]:
        """(the signal of any rank or 0, does some rank lack the next batch), as they were when
        this step began."""
        # Once a step, after it: the all-reduce is done by then.
        if self.work is not None:
            self.work.wait()
            self.work = None
        # A checkpoint being written failed (a full disk): every rank ends with its line.
        if self.values[3]:
            with errors_shared_by_all_ranks():
                self.saves.wait()
        return int(self.values[0]), bool(self.values[1])

    def save_timer_fired(self) -> bool:
        """After agreed(): did the --save-minutes timer fire on some rank as this step began? Then
        every rank saves after it, and the timer starts again."""
        if not self.values[2]:
            return False
        self.saved_at = time.monotonic()
        return True

    def steps(self, batches, first_step: int, steps: int):
        """Every rank iterates it, in the same steps: (step, batch) for steps first_step + 1 to
        steps (1-based), while every rank has a batch. It reads one batch ahead, and as each step
        begins it starts a small all-reduce (any rank's signal, any rank without a next batch) that
        agreed() awaits after the step. A batch one rank cannot read (a bad file) ends
        every rank with its line."""
        batches = iter(batches)
        step = first_step
        batch = ahead = None
        error = ""
        if step < steps:
            ahead, error = next_batch(batches)
        while True:
            # Each step starts the all-reduce that agreed() waits for: 1 where a rank has no next
            # batch, 2 where one could not read it.
            lacking = 2 if error else int(ahead is None)
            due = self.save_seconds > 0 and time.monotonic() - self.saved_at >= self.save_seconds
            # the last step's all-reduce is done: agreed() waited for it
            failed = self.saves is not None and self.saves.failed()
            self.values[:] = [self.signal, lacking, int(due), int(failed)]
            if not self.alone:
                self.work = dist.all_reduce(self.flags, dist.ReduceOp.MAX, self.group, True)
            if step > first_step:
                yield step, batch
            # A stream that ended early, or on one rank sooner: all end the epoch here.
            if self.agreed()[1]:
                break
            step += 1
            batch = ahead
            ahead = None
            if step < steps:
                ahead, error = next_batch(batches)
        if self.values[1] == 2:
            raise UsageError(next(e for e in all_gather_objects(error) if e))
        if step == 0:
            raise UsageError(
                "the training data gave no full batch this epoch: lower --batch-size or use more"
                " data"
            )


def next_batch(batches) -> tuple[object, str]:
    """(the next batch or None at the end, ""), or (None, the line) where the dataset raised a
    UsageError (the built-in image folder's file that cannot be read)."""
    try:
        return next(batches, None), ""
    except UsageError as e:
        return None, str(e)


class NoWatchdog:
    """What the scripts and the saves tell a watchdog of their progress (a batch, a save's bytes),
    told to nobody: the stand-in for extras/stalls.py's where --no-watchdog leaves it out."""

    def batch(self, epoch: int | None = None, step: int | None = None) -> None:
        pass

    def writing(self, path: Path, growing: Path | None = None) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def save_taken(self) -> None:
        pass


# ---- every random draw from the seed and where it is drawn ----


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
    """with drawn_from(seed, *where): the block's draws from the global streams come from (seed,
    *where) alone. In a rank's own process (no DataLoader worker) torch's stream is given back
    afterwards: it is the model's (dropout)."""
    kept = None
    if get_worker_info() is None:
        kept = torch.default_generator.get_state()
    seed_data_streams(derive(seed, *where))
    try:
        yield
    finally:
        if kept is not None:
            torch.default_generator.set_state(kept)


def seed_step(seed: int, epoch: int, step: int) -> None:
    """Before a step's forward: this rank's own random streams inside the model (dropout,
    stochastic depth), on the CPU and every GPU (DataParallel's replicas each their own), from
    (seed, rank, epoch, step), so that ranks draw independently and a run continued at any step
    draws what a straight one does. Python's and NumPy's global streams too: what the samples read
    in this process before (their own seeds) is given back to the step's code. No GPU work: a
    generator's seed is set on the host."""
    step_seed = derive(seed, "model", rank(), epoch, step)
    seed_data_streams(step_seed)
    if torch.cuda.is_initialized():
        for device, generator in enumerate(torch.cuda.default_generators):
            generator.manual_seed(derive(step_seed, device))


# ---- files written whole; what ends a run that went wrong ----


def write_atomically(path: Path, data: bytes | Callable, watchdog=None) -> None:
    """data, or what data(file) writes, at path: a crash or a full disk mid-write leaves the
    previous file and no temporary file; a failed write is an OSError that names path. A watchdog
    given (stalls.Watchdog) takes the temporary file's growth for progress."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    saving = contextlib.nullcontext()
    if watchdog is not None:
        saving = watchdog.writing(path, tmp)
    try:
        with saving, open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        tmp.unlink(missing_ok=True)
        # torch.save's zip writer fails again, at its end of file, after a failed write: that
        # write's error is why.
        error = e
        if isinstance(e, RuntimeError):
            error = e.__context__
        if not isinstance(error, OSError):
            raise
        raise OSError(error.errno, error.strerror, str(path)) from None


def append_metrics(path: Path, record: dict) -> None:
    """A JSON line, whole or not at all, for a continued run."""
    line = (json.dumps(record) + "\n").encode()
    # One write; what fitted of it, where the disk is full, is cut off again.
    with open(path, "ab", buffering=0) as f:
        size = f.tell()
        try:
            if f.write(line) < len(line):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            f.truncate(size)
            raise OSError(e.errno, e.strerror, str(path)) from None


def check_finite(model: nn.Module | None, epoch: int, step: int, record: dict | None, args) -> None:
    """A NaN or infinite loss or weight ends the run before a progress line (model None) or a save
    shows or keeps it."""
    losses = [value for key, value in (record or {}).items() if key.endswith("_loss")]
    finite = all(math.isfinite(value) for value in losses)
    if finite and model is not None:
        finite = all(local_shard(p).isfinite().all() for p in model.parameters())
    if finite:
        return
    where = f"in epoch {epoch}"
    if step:
        where = f"by step {step} of epoch {epoch + 1}"
    clip = ""
    if not args.clip_grad:
        clip = ", or use --clip-grad"
    raise UsageError(
        f"training diverged: the loss or the weights became NaN or infinite {where}: lower --lr"
        f" (peak {args.lr:.4g}) or lengthen --warmup ({args.warmup:g}){clip}; only finite"
        " checkpoints were saved"
    )


def describe_value(value) -> str:
    """A tensor's shape, a tuple's or list's length, or the type."""
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


# ---- the optimizer and its schedule ----


def build_optimizer(model: nn.Module, args) -> torch.optim.Optimizer:
    """--optimizer over the model's parameters, with its peak lr and weight decay (check_args fills
    their defaults); models trained together (extras/together.py): one each,
    run.optimizer["generator"]."""
    if getattr(model, "trained_together", False):
        return model.each(build_optimizer, args)
    # AdamW fused: each tensor in one pass, where foreach (the default) makes a temporary copy of
    # all the weights; not with float16 (FSDP's gradient scaler checks overflow on all ranks on the
    # foreach path only), nor for SGD (FSDP's shards have no fused SGD; and where float16's scaler
    # skips a step, fused SGD still moves its momentum: weights NaN on an H200, PyTorch 2.11).
    if args.optimizer == "adamw":
        fused = True if getattr(args, "amp_dtype", None) != "float16" else None
        return torch.optim.AdamW(
            model.parameters(), lr=args.lr, weight_decay=args.weight_decay, fused=fused
        )
    return torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay
    )


def warmup_cosine(optimizer: torch.optim.Optimizer, steps: int, warmup: float):
    """The learning-rate schedule over `steps` optimizer steps, stepped after each: a linear rise
    over its first `warmup` part, then a cosine decay to 0 (models trained together: one for each
    optimizer, run.scheduler["generator"])."""
    if getattr(optimizer, "trained_together", False):
        return optimizer.each(warmup_cosine, steps, warmup)
    rise = max(1, round(warmup * steps))

    def factor(step: int) -> float:
        if step < rise:
            return (step + 1) / rise
        decayed = (step - rise) / max(1, steps - rise)
        return 0.5 * (1 + math.cos(math.pi * decayed))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---- the flags every script shares ----


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag ends in one line, and --flag_name is accepted for --flag-name."""

    def error(self, message: str) -> None:
        # run_main prints it as it prints every other error
        raise UsageError(f"{message} (see {self.prog} --help)")

    def parse_known_args(self, args=None, namespace=None):
        if args is None:
            args = sys.argv[1:]
        return super().parse_known_args([kebab_case(arg) for arg in args], namespace)


def kebab_case(arg: str) -> str:
    """--batch_size=1_000 -> --batch-size=1_000: the flag's name only, up to an "=", not the
    value."""
    match = re.match("--[^=]+", arg)
    if match is None:
        return arg
    return match[0].replace("_", "-") + arg[match.end() :]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, but for a default computed at run time (None), which the
    flag's help describes."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser(description: str, one_process: bool = False) -> ArgumentParser:
    """The flags every script shares (README.md, "Flags"); each script's parse_args adds its
    approach's own. one_process (dataparallel.py): the rendezvous flags say they go unused."""
    p = ArgumentParser(
        description=description,
        formatter_class=HelpFormatter,
        epilog="Every flag may also be spelt with underscores: --batch_size 128.",
    )
    add = p.add_argument
    add(
        "--dataset",
        default="cifar100",
        choices=["cifar10", "cifar100", "imagefolder", "fake"],
        help="built-in data",
    )
    add("--data-dir", default="./data", help="where data lives or is downloaded to")
    add("--no-download", action="store_true", help="fail instead of downloading missing CIFAR")
    add("--fake-size", type=int, default=50_000, help="training images of --dataset fake")
    add("--image-size", type=int, default=32, help="side of imagefolder and fake images")
    add(
        "--no-augment",
        action="store_true",
        help="no random crops or flips (exact reproducibility checks)",
    )
    add("--arch", default="resnet18", help="tiny, or a torchvision classifier name")
    add("--epochs", type=int, default=30, help="planned epochs (the lr schedule spans them)")
    add(
        "--steps-per-epoch",
        type=int,
        default=None,
        metavar="N",
        help="end each epoch after N optimizer steps; a stream without __len__ needs it (default:"
        " every full batch of the training set)",
    )
    add(
        "--stop-after",
        type=int,
        default=None,
        metavar="N",
        help="end after N epochs of this run, counted from where it starts (a continued run from"
        " its checkpoint); the same command continues (default: up to --epochs)",
    )
    add(
        "--batch-size",
        type=int,
        default=256,
        help="GLOBAL batch size, split over all processes into parts that differ by at most one"
        " sample",
    )
    add("--optimizer", choices=["sgd", "adamw"], default="sgd", help="SGD with momentum, or AdamW")
    add(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate (default: sgd 0.1 x batch-size / 256, adamw 1e-3)",
    )
    add(
        "--warmup",
        type=float,
        default=0.1,
        metavar="FRACTION",
        help="part of the steps the lr rises linearly",
    )
    add("--momentum", type=float, default=0.9, help="SGD momentum")
    add(
        "--weight-decay",
        type=float,
        default=None,
        help="weight decay (default: sgd 5e-4, adamw 0.01)",
    )
    add(
        "--clip-grad",
        type=float,
        default=None,
        metavar="NORM",
        help="clip the gradients' global norm to NORM (default: no clipping)",
    )
    add(
        "--workers",
        type=int,
        default=None,
        help="DataLoader workers per process (default: 0 on a CPU; with GPUs, the cores per GPU"
        " less 2, at most 8)",
    )
    add(
        "--seed",
        type=int,
        default=0,
        help="seed for init, data order, each sample's random transforms (from seed, epoch, index)"
        " and each rank's dropout (from seed, rank, step)",
    )
    add(
        "--no-sample-seeds",
        action="store_true",
        help="leave out each sample's seeds (extras/seeds.py): its random transforms then come from"
        " the DataLoader's streams, which differ with the number of processes and workers and in a"
        " continued run",
    )
    add(
        "--print-freq",
        type=int,
        default=50,
        help="a progress line and a record in steps.jsonl every N steps",
    )
    add(
        "--eval-every",
        type=int,
        default=None,
        metavar="N",
        help="also validate every N steps (default: epoch ends)",
    )
    add(
        "--tensorboard",
        action="store_true",
        help="rank 0 also writes steps.jsonl's records to OUTPUT_DIR/tensorboard",
    )
    add(
        "--wandb",
        default=None,
        metavar="PROJECT",
        help="rank 0 also logs the records to a Weights & Biases run (default: off)",
    )
    add(
        "--ema",
        type=float,
        metavar="DECAY",
        help="also validate and save a moving average of the weights with this decay, e.g. 0.999"
        " (default: off)",
    )
    add(
        "--keep-best",
        default=None,
        metavar="NAME",
        help="also write the weights of the best validation so far by NAME to"
        " OUTPUT_DIR/model_best.pt: val_loss, val_acc, val_acc5, a val_<metric> of build_metrics,"
        " or one of these with _ema (default: off)",
    )
    add(
        "--keep-best-mode",
        choices=["min", "max"],
        default=None,
        help="with --keep-best: whether its best value is the lowest or the highest (default: min"
        " for a name with 'loss' in it, else max)",
    )
    # accepted by every script alike, so that one command line fits all; DataParallel joins no group
    unused = "; unused here: one process, no process group" if one_process else ""
    add(
        "--ip",
        default=None,
        help=f"rendezvous address for tcp:// init (default: 127.0.0.1{unused})",
    )
    add(
        "--port",
        type=int,
        default=None,
        help="rendezvous port for tcp:// init (default: 29500 where --ip is given, a free one for"
        " distributed_mp.py on one node; without either, torchrun's env:// or one process"
        f" alone{unused})",
    )
    add(
        "--dist-url",
        default=None,
        help="env://, tcp://HOST:PORT or file:///shared/path (overrides --ip/--port; default:"
        f" from --ip/--port, else env:// under torchrun{unused})",
    )
    add(
        "--backend",
        choices=["nccl", "gloo"],
        default=None,
        help=f"the collectives' library (default: nccl with CUDA, else gloo{unused})",
    )
    add(
        "--timeout",
        type=float,
        default=300,
        help=(
            "seconds a rank may make no progress (no batch, no byte saved) before every rank"
            " ends, naming it; before the first step, how long a rank may wait for another (the"
            " rendezvous, a collective); start-up work itself has no bound"
        ),
    )
    add(
        "--no-watchdog",
        action="store_true",
        help="leave out the stall watchdog (extras/stalls.py): a stalled rank then holds the others"
        " until a collective times out, --timeout + 30 s, unnamed; no live line either",
    )
    add(
        "--no-checks",
        action="store_true",
        help="leave out the start-up checks (extras/checks.py): what the plug points return, a step"
        " of two samples (undone) and FSDP's memory, each mistake said in one line before training;"
        " without them a mistake is found late, as PyTorch's error or a wrong number (an empty"
        " validation set's loss of 0, draws that differ between ranks), and no TFLOP/s or mfu are"
        " recorded (the step counts the FLOPs)",
    )
    add(
        "--channels-last",
        action="store_true",
        help="NHWC model and images (faster on Tensor Cores; not with FSDP, which shards"
        " contiguous weights only)",
    )
    add(
        "--peak-tflops",
        type=float,
        default=None,
        metavar="T",
        help="a GPU's dense peak TFLOP/s at the run's precision, for the epoch's mfu (default: from"
        " a table of known GPUs; none on a CPU)",
    )
    add(
        "--no-live-line",
        action="store_true",
        help="no live line on a terminal (rank 0's step of steps and time left, rewritten in place"
        " about once a second; never where standard error is a pipe or a file)",
    )
    add(
        "--phases",
        action="store_true",
        help="time each phase of a step (data, forward, backward, wait, optimizer) on every rank:"
        " each record's phase_ms, and a rank slower than the others named",
    )
    add(
        "--profile",
        default=None,
        metavar="A:B",
        help="torch.profiler over optimizer steps A to B of the run (default: off), the step's"
        " phases marked: a Chrome trace a rank in OUTPUT_DIR/profile/",
    )
    add("--compile", action="store_true", help="compile the model with torch.compile")
    add(
        "--compile-mode",
        choices=["default", "reduce-overhead", "max-autotune"],
        help="torch.compile's mode; implies --compile (default: its own, 'default')",
    )
    add(
        "--output-dir",
        default="./output",
        help="where rank 0 writes checkpoint.pt (FSDP: every rank its shards of checkpoint/, and"
        " model.pt), metrics.jsonl and steps.jsonl",
    )
    add(
        "--save-every",
        type=int,
        default=None,
        metavar="N",
        help="also save a checkpoint every N optimizer steps (default: at epoch ends only)",
    )
    add(
        "--save-minutes",
        type=float,
        default=None,
        metavar="M",
        help="also save a checkpoint every M minutes of training (at a step all ranks agree on):"
        " a lost node costs at most that (default: off)",
    )
    return p


def add_ddp_flags(parser: ArgumentParser) -> None:
    """DDP's own flags, of the four DDP scripts."""
    parser.add_argument(
        "--sync-bn",
        action="store_true",
        help="batch-norm statistics over the global batch, all ranks' samples (PyTorch's"
        " SyncBatchNorm on GPUs; on CPU processes the same over gloo)",
    )
    parser.add_argument(
        "--find-unused-parameters",
        action="store_true",
        help="allow parameters without a gradient in some steps",
    )
    parser.add_argument(
        "--comm-hook",
        choices=["bf16"],
        default=None,
        help="all-reduce the gradients in bfloat16, half the bytes (PyTorch's bf16_compress_hook;"
        " default: float32 as they are)",
    )


def memory_format(args) -> torch.memory_format:
    """--channels-last: NHWC; otherwise the weights' own."""
    return torch.channels_last if args.channels_last else torch.preserve_format


def check_args(args: argparse.Namespace) -> argparse.Namespace:
    """Catch impossible values before any process group or data is touched; fill machine
    defaults. Returns args."""
    at_least_one = "epochs batch_size fake_size image_size print_freq eval_every stop_after"
    for name in f"{at_least_one} save_every steps_per_epoch".split():
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if (args.workers is not None and args.workers < 0) or args.seed < 0:
        raise UsageError("--workers and --seed must be >= 0")
    # not (value > 0): a NaN is refused too
    positive = (args.timeout, args.clip_grad, args.save_minutes, args.peak_tflops)
    if any(value is not None and not value > 0 for value in positive):
        raise UsageError("--timeout, --clip-grad, --save-minutes and --peak-tflops must be > 0")
    if any(v is not None and not v >= 0 for v in (args.lr, args.momentum, args.weight_decay)):
        raise UsageError("--lr, --momentum and --weight-decay must be >= 0")
    if args.port is not None and not 0 < args.port < 65536:
        raise UsageError(f"--port {args.port} is not a port: give 1 to 65535")
    if not 0 <= args.warmup < 1:
        raise UsageError("--warmup must be in [0, 1)")
    if args.ema is not None and not 0 <= args.ema < 1:
        message = "the average spans about 1 / (1 - DECAY) steps"
        raise UsageError(f"--ema {args.ema:g} is not in [0, 1): {message}")
    if args.backend == "nccl" and not torch.cuda.is_available():
        raise UsageError("--backend nccl needs GPUs, and none is visible: leave it out for gloo")
    args.compile = args.compile or args.compile_mode is not None
    if args.keep_best_mode is not None and args.keep_best is None:
        raise UsageError("--keep-best-mode needs --keep-best NAME, the validation figure it ranks")
    # --keep-best: lower is better for a loss (timm's rule), higher for the rest
    if args.keep_best_mode is None and args.keep_best is not None:
        args.keep_best_mode = "min" if "loss" in args.keep_best else "max"
    # Optional packages are checked before any data or model is built.
    # torch.utils.tensorboard imports tensorboard.
    for flag, module in (("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb")):
        if getattr(args, flag):
            try:
                importlib.import_module(module)
            except ImportError:
                raise UsageError(f"--{flag} needs the {flag} package: pip install {flag}") from None
    # SGD follows the linear scaling rule (Goyal et al. 2017): 0.1 per 256 samples.
    if args.lr is None and args.optimizer == "adamw":
        args.lr = 1e-3
    elif args.lr is None:
        args.lr = 0.1 * args.batch_size / 256
    if args.weight_decay is None and args.optimizer == "adamw":
        args.weight_decay = 0.01
    elif args.weight_decay is None:
        args.weight_decay = 5e-4
    # Workers: the cores each GPU can spare, one kept for the training loop itself.
    if args.workers is None:
        gpus = torch.cuda.device_count()
        args.workers = min(8, max(0, (os.cpu_count() or 1) // gpus - 2)) if gpus else 0
    return args


# ---- errors: one line for what a user can act on ----


class UsageError(Exception):
    """A mistake the user can fix: printed as one line, exit status 1."""

    def __str__(self) -> str:
        text = super().__str__()
        # One raised in a DataLoader worker (a file that cannot be read) comes with the worker's
        # traceback, its own line last.
        if text.startswith("Caught UsageError in DataLoader worker"):
            return text.rsplit("UsageError: ", 1)[-1].strip()
        return text


def first_line(error: BaseException) -> str:
    """The error's first line: PyTorch's distributed errors append a C++ stack trace."""
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


def raised_in(error: BaseException, *places: str) -> bool:
    """Was error raised (its innermost frame) in one of these files or folders: a library's or
    ours, not the user's?"""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(places)


def called_from(error: BaseException) -> str:
    """', at collate (distributed.py:66)': the user's line that called the library that raised
    error, if any."""
    frames = traceback.extract_tb(error.__traceback__)
    # Below this folder's frames: in the user's collate or model, not the script's call.
    ours = [i for i, frame in enumerate(frames) if frame.filename.startswith(OURS)]
    below = frames[ours[-1] + 1 :] if ours else frames
    frame = user_frame(below)
    if frame is None:
        return ""
    return f", at {frame.name} ({Path(frame.filename).name}:{frame.lineno})"


@contextlib.contextmanager
def refused_as_one_line(what: str, then: str = ""):
    """A library's refusal inside (torch's: a layer's shapes, a loss's dtypes, default_collate's
    sizes) as one line: what, its words at the user's line that called it, then; an error the
    user's code raised itself is theirs, traceback and all."""
    try:
        yield
    except (RuntimeError, ValueError, AssertionError, TypeError, IndexError, KeyError) as e:
        if not raised_in(e, *LIBRARIES):
            raise
        raise UsageError(f"{what}: {first_line(e)}{called_from(e)}{then}") from None


class Stopped(Exception):
    """Stopped by a signal after a step all ranks agreed on, and saved there."""

    def __init__(self, signum: int, epoch: int, step: int, steps: int):
        super().__init__(
            f"stopped by {signal.Signals(signum).name} after step {step}/{steps} of epoch"
            f" {epoch + 1}, saved: the same command continues from there"
        )
        self.signum = signum


def write_line(line: str) -> None:
    """A line on stderr in one write(): print() writes the newline apart, so the lines of ranks
    failing at once could run together. On a terminal the line the cursor is on is cleared first:
    where rank 0's live line stands (extras/live.py), another rank's line replaces it."""
    sys.stderr.write(("\r\033[K" if sys.stderr.isatty() else "") + f"{line}\n")


def run_main(
    main: Callable[[contextlib.ExitStack], None], say: Callable[[str], object] = write_line
) -> None:
    """Run main(teardown); a user's error ends in one line, said (printed, or sent to
    distributed_mp.py's parent), and exit status 1. What main enters in teardown (the watchdog)
    is closed as main ends, before the error's line."""
    exit_code = 0
    line = None
    try:
        # Closed before the except blocks: a watchdog ending the run (this error followed from the
        # stall) ends it alone, with its own line.
        with contextlib.ExitStack() as teardown:
            main(teardown)
    except Stopped as e:
        write_line(str(e))
        exit_code = 128 + e.signum  # as a shell reports a process ended by that signal
    except UsageError as e:
        line = f"error: {e}"
    except torch.cuda.OutOfMemoryError:
        line = "error: out of GPU memory: lower --batch-size"
    except KeyboardInterrupt:
        line = "interrupted"
    except Exception as e:
        line = error_line(e)
        if line is None:
            # A bug, the user's or ours: its traceback in one write (print_exc writes it a line
            # at a time, and the ranks that raise at once would interleave theirs).
            write_line(traceback.format_exc().rstrip("\n"))
            exit_code = 1
    finally:
        # A line to say: torchrun's SIGTERM, sent once another rank has ended with the same error,
        # waits for it (the teardown below can take a loaded machine a second).
        if line is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # After the except blocks, whose exception kept main's frames (the model, DDP, FSDP)
        # alive: free them and their process groups while the interpreter is whole.
        gc.collect()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if line is not None:
        # said once a node, where its ranks all end with it; each rank's is in torchrun's summary
        if first_to_say(line):
            say(line)
        record_for_torchrun(line)
        exit_code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # A run ends as a Python program does, so that the user's atexit handlers and finally blocks
    # run: returning, or sys.exit with its status.
    if exit_code:
        sys.exit(exit_code)


def first_to_say(line: str) -> bool:
    """Is this rank the first of its node to end with line? Under torchrun the ranks of a node
    share their attempt's folder (the parent of each rank's error file's folder): the first to
    create a file named for the line there says it. Without torchrun, every process says its own
    (distributed_mp.py's parent says one)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    # torchrun's layout: ATTEMPT/LOCAL_RANK/error.json, a new attempt folder each start
    if not path or not Path(path).parents[1].name.startswith("attempt_"):
        return True
    said = Path(path).parents[1] / f"said-{hashlib.sha256(line.encode()).hexdigest()[:16]}"
    try:
        os.close(os.open(said, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:
        pass  # the folder cannot be written: said by each rank, as without torchrun
    return True


def record_for_torchrun(line: str) -> None:
    """Under torchrun: the line in its error file (TORCHELASTIC_ERROR_FILE), so that the summary of
    failed processes it prints after the ranks' lines names the cause ("traceback : ...") instead
    of a link to its docs. What torchrun reads is its ErrorHandler's format."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    # without "error: ": the ranks' own lines stay the only ones that start so
    cause = line.removeprefix("error: ")
    message = {
        "message": cause,
        "extraInfo": {"py_callstack": cause, "timestamp": str(int(time.time()))},
    }
    try:
        with open(path, "w") as f:
            json.dump({"message": message}, f)
    except OSError:
        pass  # the summary points at torchrun's docs, as without it


def error_line(error: Exception) -> str | None:
    """The one line for an error the user can act on that is not theirs to debug: a DataLoader
    worker killed, a failed collective, an extra deleted from the copy. None for any other (a bug,
    the user's or ours), which keeps its traceback."""
    # An extra deleted from this copy while a flag, or the machine (a GPU, a terminal, torchrun),
    # still enters a block that imports it.
    missing = re.match(r"cannot import name '(\w+)' from 'extras'", str(error))
    if isinstance(error, ImportError) and missing:
        return (
            f"error: extras/{missing[1]}.py is not in this copy{called_from(error)}: copy it from"
            " the repository, or delete the block that imports it (or leave out its flag)"
        )
    if not isinstance(error, (RuntimeError, ConnectionError, TimeoutError)):
        return None
    # A worker killed (out of memory, of /dev/shm) or crashed in C code, or a dataset too large
    # for /dev/shm. PyTorch's own line is the cause where it saw the signal (a forked worker).
    text = str(error)
    if text.startswith("DataLoader worker") or "unable to write to file </torch_" in text:
        said = error
        if str(error.__cause__).startswith("DataLoader worker"):
            said = error.__cause__
        what = first_line(said).split(". ")[0].rstrip(".")
        return (
            f"error: {what}: lower --workers or --batch-size where memory or /dev/shm ran out"
            " (docker run --shm-size), or see a crash with --workers 0"
        )
    # gloo reports a dead peer or a timeout as a plain RuntimeError (DistError is one too), raised
    # in torch or here; any other (a stream's own ConnectionError) is a bug: keep its traceback.
    words = r"gloo|nccl|[Cc]onnection|[Tt]imed out|[Tt]imeout|peer"
    in_torch = raised_in(error, str(Path(torch.__file__).parent), *OURS)
    if isinstance(error, dist.DistError) or (in_torch and re.search(words, text)):
        said = first_line(error)
        # a peer gone: said so, in gloo's words without its source paths and its sign-off
        peer_gone = r"Connection (closed|reset) by peer[^.]*|Broken pipe|remote process exited"
        gone = re.search(peer_gone, said)
        if gone:
            said = f"another process ended first (its own error says why): {gone[0]}"
        return f"error: distributed communication failed: {said}"
    return None


# The files of the standard library and installed packages, torch's wherever it is installed.
LIBRARIES = tuple(
    {
        *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")),
        str(Path(torch.__file__).parents[1]),
    }
)


# This file and the extras beside it: ours, not the user's (the scripts are the user's to edit).
OURS = (
    os.path.abspath(__file__),
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "extras", ""),
)


def user_frame(frames: list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost frame of the user's code or the script (one of ours if none): not a
    library's."""
    not_libraries = [f for f in frames if not f.filename.startswith((*LIBRARIES, "<"))]
    for frame in reversed(not_libraries):
        if not frame.filename.startswith(OURS):
            return frame
    if not_libraries:
        return not_libraries[-1]
    return None
