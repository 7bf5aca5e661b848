"""Small helpers shared by the five training scripts.

Everything here is what every script needs and no script owns: clear errors,
rank-0 logging, reductions over ranks, data, models, exact distributed
evaluation and checkpoint I/O. The scripts themselves hold what differs
between them: how processes start and how a training step runs.
"""
from __future__ import annotations

import argparse
import errno
import functools
import inspect
import json
import logging
import math
import os
import re
import resource
import socket
import sys
import time
import uuid
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import urlparse

import numpy as np

# PyTorch's C++ side logs rendezvous retries with stack dumps; our errors say it in one
# line. Must be set before torch loads; TORCH_CPP_LOG_LEVEL=INFO shows everything again.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
import torch  # noqa: E402
import torch.distributed as dist
import torch.nn as nn
import torchvision
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler
from torchvision import transforms

log = logging.getLogger("train")

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
FAKE_CLASSES = 10
FAKE_VAL_FRACTION = 5  # fake validation set = fake_size // 5 images


# ---------------------------------------------------------------- errors ----

class UsageError(Exception):
    """A mistake the user can fix: printed as one line, exit status 1."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag ends with one line instead of the usage block."""

    def error(self, message: str) -> None:
        sys.exit(f"{self.prog}: error: {message} (see --help)")


def build_parser(description: str) -> ArgumentParser:
    """The flags every script shares (../shared/CONTRACT.md); scripts add their own."""
    p = ArgumentParser(description=description,
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", default="cifar100", choices=["cifar10", "cifar100", "imagefolder", "fake"],
                   help="training data; fake needs no files and no network")
    p.add_argument("--data-dir", default="./data", help="where data lives or is downloaded to")
    p.add_argument("--no-download", action="store_true", help="fail instead of downloading missing CIFAR")
    p.add_argument("--fake-size", type=int, default=50_000, help="training images of --dataset fake")
    p.add_argument("--image-size", type=int, default=32, help="side of imagefolder and fake images")
    p.add_argument("--no-augment", action="store_true",
                   help="no random crops or flips (exact reproducibility checks)")
    p.add_argument("--arch", default="resnet18", help="tiny, or a torchvision classifier name")
    p.add_argument("--epochs", type=int, default=30, help="planned epochs (the lr schedule spans them)")
    p.add_argument("--stop-after", type=int, default=None, metavar="N",
                   help="end this run after N epochs; the same command continues later")
    p.add_argument("--batch-size", type=int, default=256,
                   help="GLOBAL batch size, split evenly over all processes")
    p.add_argument("--lr", type=float, default=0.1, help="peak learning rate (cosine decay per epoch)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--weight-decay", type=float, default=5e-4, help="SGD weight decay")
    p.add_argument("--workers", type=int, default=None,
                   help="DataLoader worker processes per process (default: the CPU cores each GPU "
                        "can spare, at most 8; 0 on a CPU-only machine, where training uses every core)")
    p.add_argument("--seed", type=int, default=0, help="seed for init, data order and augmentation")
    p.add_argument("--print-freq", type=int, default=50, help="log every N steps")
    p.add_argument("--ip", default=None, help="rendezvous address for tcp:// init (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="rendezvous port for tcp:// init")
    p.add_argument("--dist-url", default=None,
                   help="init method: env://, tcp://HOST:PORT or file:///shared/path (overrides --ip/--port)")
    p.add_argument("--backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl with CUDA, else gloo")
    p.add_argument("--timeout", type=float, default=300,
                   help="seconds before a stuck rendezvous or collective fails")
    p.add_argument("--sync-bn", action="store_true", help="synchronise batch-norm statistics over GPUs")
    p.add_argument("--channels-last", action="store_true",
                   help="NHWC memory layout for model and images (faster convolutions on Tensor Cores)")
    p.add_argument("--compile", action="store_true", help="compile the model with torch.compile")
    p.add_argument("--output-dir", default="./output", help="where rank 0 writes checkpoint.pt and metrics.jsonl")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Catch impossible values before any process group or data is touched."""
    for name in ("epochs", "batch_size", "fake_size", "image_size", "print_freq"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if (args.workers or 0) < 0 or args.timeout <= 0:
        raise UsageError("--workers must be >= 0 and --timeout > 0")
    if args.stop_after is not None and args.stop_after < 1:
        raise UsageError("--stop-after must be at least 1")


def first_line(error: BaseException) -> str:
    """PyTorch's distributed errors append a C++ stack trace: keep line one."""
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


def failure_message(error: BaseException) -> str | None:
    """The one line to print for an error a user can cause; None for a bug (keep its traceback)."""
    if isinstance(error, UsageError):
        return f"error: {error}"
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return "error: out of GPU memory: lower --batch-size"
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    # gloo reports a dead peer or a timeout as a plain RuntimeError
    if isinstance(error, (dist.DistError, ConnectionError, TimeoutError)) or (
            isinstance(error, RuntimeError)
            and re.search(r"gloo|nccl|[Cc]onnection|[Tt]imed out|[Tt]imeout|peer", str(error))):
        return f"error: distributed communication failed: {first_line(error)}"
    return None


def run_main(main: Callable[[], None]) -> None:
    """Run main(); turn user errors into one line and a non-zero exit; always tear down."""
    try:
        main()
    except (Exception, KeyboardInterrupt) as e:
        message = failure_message(e)
        if message is None:
            raise
        sys.exit(message)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


# --------------------------------------------------------------- logging ----

def setup_logging(rank: int) -> None:
    """Rank 0 prints progress; other ranks print warnings and errors only."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(message)s" if rank == 0 else f"[rank {rank}] %(message)s",
        stream=sys.stdout, force=True)


def format_seconds(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


# ----------------------------------------------------------- distributed ----

def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all ranks, in place; a no-op in a single process."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """Mean of a tensor over all ranks (a copy: the input is left alone)."""
    return all_reduce_sum(tensor.detach().clone()) / world_size()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on host."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_batch_size(batch_size: int, parts: int, what: str) -> int:
    """The batch of each of parts (described by what); a clear error if it does not split evenly."""
    if batch_size % parts or batch_size < parts:
        raise UsageError(f"--batch-size {batch_size} does not split evenly over {what}: "
                         f"use a multiple of {parts}")
    return batch_size // parts


def rendezvous_store(init_method: str | None, rank: int, world_size: int,
                     timeout: timedelta) -> dist.Store:
    """The key-value store where the processes meet, for init_process_group(store=...)."""
    if init_method is None:
        return dist.HashStore()  # a world of one needs no network
    url = urlparse(init_method)
    if url.scheme == "file":
        return dist.FileStore(url.path, world_size)
    if url.scheme == "env":
        address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun hosts the store
            host, port = address.rsplit(":", 1)
            agent_store = dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timeout)
            return fresh_namespace(agent_store, rank, world_size, timeout)
        url = urlparse(f"tcp://{address}")  # Slurm, or MASTER_ADDR set by hand
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        raise UsageError(f"cannot use {init_method}: give env://, tcp://HOST:PORT or file:///PATH")
    listen_fd = None
    if rank == 0:
        # TCPStore alone would listen on every interface; listen on the given address only
        try:
            listen_fd = socket.create_server((url.hostname, url.port)).detach()
        except OSError as e:
            reason = ("the port is in use; choose another --port" if e.errno == errno.EADDRINUSE
                      else f"{e.strerror}; the address must be one of this machine (node 0)")
            raise UsageError(f"cannot listen on tcp://{url.hostname}:{url.port}: {reason}") from None
    return dist.TCPStore(url.hostname, url.port, world_size, is_master=rank == 0,
                         timeout=timeout, master_listen_fd=listen_fd)


def fresh_namespace(store: dist.Store, rank: int, world_size: int,
                    timeout: timedelta) -> dist.Store:
    """A part of store that no earlier group of this job has written to.

    torchrun keeps its store when it restarts workers, so new workers would
    read the dead ones' addresses and fail or hang (PyTorch issue 135712), and
    its restart count differs between nodes. So rank 0 draws a new generation
    number and hands it to every rank that asks with a fresh token; answers to
    stale tokens left by dead workers are never read.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        generation = store.add("ddp/generation", 1)
        answered = set()
        while store.add(f"ddp/{generation}/joined", 0) < world_size - 1:
            hellos = [f"ddp/hello/{r}" for r in range(1, world_size)]
            for token in store.multi_get([k for k in hellos if store.check([k])]):
                if token not in answered:
                    store.set(f"ddp/answer/{token.decode()}", str(generation))
                    answered.add(token)
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {store.add(f'ddp/{generation}/joined', 0) + 1} of "
                                   f"{world_size} processes arrived within {timeout.total_seconds():.0f} s")
            time.sleep(0.01)
    else:
        token = uuid.uuid4().hex
        store.set(f"ddp/hello/{rank}", token)
        store.wait([f"ddp/answer/{token}"], timeout)
        generation = int(store.get(f"ddp/answer/{token}"))
        store.add(f"ddp/{generation}/joined", 1)
    return dist.PrefixStore(f"ddp/{generation}/", store)


def describe_init_error(error: Exception, init_method: str) -> str:
    """Turn a failed rendezvous into a line that says what to change."""
    text = first_line(error)
    if re.search(r"address already in use|EADDRINUSE|errno: 98", str(error), re.I):
        return f"cannot listen on {init_method}: the port is in use; choose another --port"
    if isinstance(error, (dist.DistStoreError, TimeoutError)) or "timed out" in text.lower() \
            or "timeout" in text.lower():
        return (f"rendezvous at {init_method} timed out: is the address reachable and are all "
                f"processes started? ({text})")
    return f"rendezvous at {init_method} failed: {text}"


def set_cpu_threads(local_world_size: int) -> None:
    """Processes that share a machine's cores must not each use all of them."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))


def slurm_master_addr(nodelist: str) -> str:
    """First host of a Slurm node list, compressed or not: 'node[01-04],gpu7' -> 'node01'."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise UsageError(f"cannot read a host from Slurm node list {nodelist!r}")
    prefix, ranges = match.groups()
    return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "")


# ----------------------------------------------------------------- data ----

class TensorImages(Dataset):
    """A whole image set held as one uint8 tensor (N, 3, H, W): CIFAR and fake data.

    __getitems__ fetches a batch with one indexing operation instead of one
    PIL image per sample, which is most of what an input pipeline costs at 32x32.
    """

    def __init__(self, images: np.ndarray, targets, classes: list[str]):
        self.images = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()  # from (N, H, W, 3)
        self.targets = torch.as_tensor(targets, dtype=torch.long)
        self.classes = list(classes)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.targets[index]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(indices)
        return self.images[index], self.targets[index]


class FolderImages(torchvision.datasets.ImageFolder):
    """ImageFolder whose __getitems__ returns a stacked uint8 batch, like TensorImages."""

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        images, targets = zip(*(self[i] for i in indices))
        return torch.stack(images), torch.tensor(targets)


def fake_images(size: int, image_size: int, split: str, seed: int = 0) -> TensorImages:
    """Learnable uint8 images: each class has a colour pattern, plus noise.

    Held like CIFAR (TensorImages), so they cost what CIFAR costs per image.
    The same (seed, split) always gives the same images.
    """
    split_seed = {"train": 1, "val": 2}[split]
    patterns = np.random.default_rng(seed).integers(
        0, 256, (FAKE_CLASSES, 4, 4, 3)).astype(np.float32)
    patterns = patterns.repeat(math.ceil(image_size / 4), 1).repeat(math.ceil(image_size / 4), 2)
    patterns = patterns[:, :image_size, :image_size]
    rng = np.random.default_rng(seed * 10 + split_seed)
    targets = rng.integers(0, FAKE_CLASSES, size)
    noise = rng.normal(0, 64, (size, image_size, image_size, 3)).astype(np.float32)
    images = np.clip(patterns[targets] * 0.6 + 50 + noise, 0, 255).astype(np.uint8)
    return TensorImages(images, targets, [str(c) for c in range(FAKE_CLASSES)])


def random_crop_flip(images: torch.Tensor, top: torch.Tensor, left: torch.Tensor,
                     flip: torch.Tensor, padding: int) -> torch.Tensor:
    """Crop image i of a batch at (top[i], left[i]) of its zero-padded self, then flip it if flip[i].

    Per image, the same as torchvision's RandomCrop(size, padding) followed by
    RandomHorizontalFlip, given the same draws; here a whole batch at once.
    """
    n, c, h, w = images.shape
    flat = nn.functional.pad(images, (padding,) * 4).flatten()
    height, width = h + 2 * padding, w + 2 * padding
    # Every output row is w consecutive bytes of the padded batch, read forwards, or
    # backwards if flipped: one index_select gathers them all from the padded batch
    # followed by its mirror image (a per-element gather is about 10x slower on CPU).
    source = torch.cat([flat, flat.flip(0)])
    runs = source.as_strided((len(source) - w + 1, w), (1, 1))  # runs[k] = source[k:k + w]
    rows = torch.arange(n * c, device=images.device).view(n, c, 1) * height + top.view(n, 1, 1) \
        + torch.arange(h, device=images.device)
    starts = rows * width + left.view(n, 1, 1)
    mirrored = len(source) - starts - w  # the same w bytes, reversed, in the second half
    starts = torch.where(flip.view(n, 1, 1), mirrored, starts)
    return runs.index_select(0, starts.flatten()).view(n, c, h, w)


class AugmentedBatches(Dataset):
    """CIFAR-style augmentation (padded random crop, horizontal flip) of whole batches.

    torchvision's RandomCrop and RandomHorizontalFlip draw once per call, so
    they run image by image (about 110 us each at 32x32 on one core); this
    does a batch in one pass (about 4 us an image). Each image's crop and flip
    come from a table drawn from (seed, epoch) alone and indexed by the image,
    so they do not depend on the rank, the DataLoader worker, the world size
    or a restart: 1 and N processes, and a resumed run, see identical inputs.
    Its sampler yields (index, epoch) pairs (EpochIndexSampler).
    """

    def __init__(self, dataset: Dataset, seed: int, padding: int):
        self.dataset, self.seed, self.padding = dataset, seed, padding
        self.epoch, self.table = None, None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, keys: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        indices = [index for index, _ in keys]
        images, targets = self.dataset.__getitems__(indices)
        top, left, flip = self.draws(keys[0][1])[torch.as_tensor(indices)].unbind(1)
        return random_crop_flip(images, top, left, flip.bool(), self.padding), targets

    def draws(self, epoch: int) -> torch.Tensor:
        """(top, left, flip) for every image of the dataset in this epoch."""
        if epoch != self.epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            shifts = torch.randint(0, 2 * self.padding + 1, (len(self), 2), generator=generator)
            flips = torch.randint(0, 2, (len(self), 1), generator=generator)
            self.epoch, self.table = epoch, torch.cat([shifts, flips], 1)
        return self.table


class EpochIndexSampler(DistributedSampler):
    """DistributedSampler that yields (index, epoch), for AugmentedBatches."""

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((index, self.epoch) for index in super().__iter__())


class ShardSampler(Sampler):
    """Rank r takes images r, r+W, r+2W, ...: every image exactly once, no padding.

    DistributedSampler pads the last shard with repeated images (or drops
    some with drop_last), which skews validation; this does neither.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int):
        self.indices = range(rank, len(dataset), num_replicas)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def already_batched(batch):
    """collate_fn for datasets whose __getitems__ returns a whole batch."""
    return batch


def prepare_images(images: torch.Tensor, device: torch.device, channels_last: bool) -> torch.Tensor:
    """A uint8 batch to normalised float32 on the device (a quarter of the bytes to copy)."""
    images = images.to(device, non_blocking=True)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    mean, std = normalisation(device)
    return (images.float() - mean) / std


@functools.lru_cache
def normalisation(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """CIFAR mean and std in uint8 units, made once per device instead of every step."""
    as_tensor = lambda values: torch.tensor(values, device=device).view(1, 3, 1, 1) * 255  # noqa: E731
    return as_tensor(CIFAR_MEAN), as_tensor(CIFAR_STD)


def build_datasets(args, local_rank: int) -> tuple[Dataset, Dataset, int]:
    """(train, val, number of classes) for --dataset, as uint8 images; a clear error if data is missing.

    Augmentation is not here: build_loaders() applies it to whole batches.
    """
    if args.dataset == "fake":
        train = fake_images(args.fake_size, args.image_size, "train")
        val = fake_images(max(1, args.fake_size // FAKE_VAL_FRACTION), args.image_size, "val")
    elif args.dataset == "imagefolder":
        root = Path(args.data_dir)
        for split in ("train", "val"):
            if not (root / split).is_dir():
                raise UsageError(f"{root / split} not found: --dataset imagefolder reads "
                                 f"DATA_DIR/train/<class>/* and DATA_DIR/val/<class>/*")
        resize = transforms.Compose([transforms.Resize(args.image_size),
                                     transforms.CenterCrop(args.image_size), transforms.PILToTensor()])
        try:
            train = FolderImages(str(root / "train"), resize)
            val = FolderImages(str(root / "val"), resize)
        except (FileNotFoundError, OSError) as e:
            raise UsageError(f"cannot read images under {root}: {first_line(e)}") from None
        if train.classes != val.classes:
            raise UsageError(f"{root}/train and {root}/val have different class folders")
    else:
        cls = torchvision.datasets.CIFAR10 if args.dataset == "cifar10" else torchvision.datasets.CIFAR100
        download_once_per_node(cls, args, local_rank)
        train, val = (cls(args.data_dir, train=split) for split in (True, False))
        train, val = (TensorImages(d.data, d.targets, d.classes) for d in (train, val))
    return train, val, len(train.classes)


def download_once_per_node(cls, args, local_rank: int) -> None:
    """One process per machine downloads; the others wait, and all fail together."""
    error = ""
    if local_rank == 0:
        try:
            cls(args.data_dir, train=True, download=not args.no_download)
            cls(args.data_dir, train=False, download=not args.no_download)
        except (RuntimeError, OSError) as e:
            how = "--no-download was given" if args.no_download else "the download failed"
            error = f"{args.dataset} not found in {args.data_dir} and {how} ({first_line(e)})"
    errors = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    if any(errors):
        raise UsageError(next(e for e in errors if e))


def default_workers() -> int:
    """Spare cores per GPU (one per process is kept for the training loop itself)."""
    gpus = torch.cuda.device_count()
    return min(8, max(0, (os.cpu_count() or 1) // gpus - 2)) if gpus else 0


def build_loaders(train_set: Dataset, val_set: Dataset, batch_size: int, args, rank: int,
                  num_replicas: int, pin_memory: bool) -> tuple[DataLoader, DataLoader]:
    """Training shards drop the remainder (equal steps on every rank); validation shards keep every image."""
    workers = default_workers() if args.workers is None else args.workers
    common = dict(num_workers=workers, pin_memory=pin_memory, persistent_workers=workers > 0,
                  collate_fn=already_batched)
    if args.no_augment:
        sampler = DistributedSampler(train_set, num_replicas, rank, shuffle=True, seed=args.seed,
                                     drop_last=True)
    else:
        sampler = EpochIndexSampler(train_set, num_replicas, rank, shuffle=True, seed=args.seed,
                                    drop_last=True)
        train_set = AugmentedBatches(train_set, args.seed, padding=args.image_size // 8)
    train = DataLoader(train_set, batch_size, sampler=sampler, drop_last=True, **common)
    val = DataLoader(val_set, batch_size, sampler=ShardSampler(val_set, num_replicas, rank), **common)
    if len(train) == 0:
        raise UsageError(f"{len(train_set)} training images make no full batch of {batch_size} per "
                         f"process: lower --batch-size or use more data")
    return train, val


# ---------------------------------------------------------------- models ----

class TinyNet(nn.Sequential):
    """A small CNN for tests: smooth GELU, strided convolutions, no max-pool,
    batch norm or dropout, so float32 runs agree to 1e-5 across world sizes."""

    def __init__(self, num_classes: int):
        super().__init__(
            nn.Conv2d(3, 16, 3, padding=1), nn.GELU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.GELU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.GELU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes))


def build_model(arch: str, num_classes: int, image_size: int) -> nn.Module:
    """tiny, or any torchvision classifier; ResNets get a 3x3 stem and no max-pool for small images."""
    if arch == "tiny":
        return TinyNet(num_classes)
    names = torchvision.models.list_models(module=torchvision.models)
    if arch not in names:
        raise UsageError(f"unknown --arch {arch!r}: use tiny or a torchvision classifier "
                         f"such as resnet18, resnet50, mobilenet_v3_small, vit_b_16")
    extra = {"image_size": image_size} if arch.startswith("vit_") else {}
    model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **extra)
    if image_size <= 64 and isinstance(model, torchvision.models.ResNet):
        # the ImageNet stem would shrink 32x32 inputs to 8x8 before the first block
        model.conv1 = nn.Conv2d(3, model.conv1.out_channels, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
    return model


def train_flops_per_image(model: nn.Module, image_size: int, device: torch.device) -> float:
    """FLOPs of one image's forward and backward pass, counted once, before training.

    Eval mode, so batch-norm statistics are left untouched; the gradients are dropped.
    """
    was_training = model.training
    model.eval()
    images = torch.randn(2, 3, image_size, image_size, device=device)
    with FlopCounterMode(display=False) as counter:
        model(images).float().sum().backward()
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    return counter.get_total_flops() / 2


def peak_memory_mb(device: torch.device) -> float:
    """Peak GPU memory allocated by this process, or its peak resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def no_buffer_sync_per_forward() -> dict[str, bool]:
    """DDP's keyword that stops it broadcasting rank 0's buffers before every forward
    (`forward_sync_buffers` in newer PyTorch, `broadcast_buffers` before)."""
    params = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside DDP / DataParallel / torch.compile wrappers."""
    while True:
        if hasattr(model, "module"):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def cosine_schedule(optimizer: torch.optim.Optimizer, epochs: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Cosine decay over the planned epochs, stepped once per epoch."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda epoch: 0.5 * (1 + math.cos(math.pi * epoch / epochs)))


# ------------------------------------------------------------- metering ----

class Meter:
    """Sums of loss, correct predictions and images, kept on the device
    (no host sync per step) and reduced over ranks only when read."""

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)

    @torch.no_grad()
    def update(self, loss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        n = targets.numel()
        correct = (logits.argmax(1) == targets).sum()
        self.sums += torch.stack([loss.detach().double() * n, correct.double(),
                                  torch.tensor(n, dtype=torch.float64, device=self.sums.device)])

    def reduce(self) -> tuple[float, float, int]:
        """(mean loss, accuracy, images) over all ranks; a collective: call on every rank."""
        loss_sum, correct, count = all_reduce_sum(self.sums.clone()).tolist()
        return loss_sum / max(count, 1), correct / max(count, 1), int(count)


def log_progress(meter: Meter, timer: "Timer", epoch: int, epochs: int, step: int, steps: int,
                 lr: float) -> None:
    """One progress line on rank 0 (a collective: every rank calls it at the same step)."""
    loss, acc, images = meter.reduce()
    seconds = timer.elapsed()
    log.info(f"epoch {epoch + 1}/{epochs} step {step}/{steps} loss {loss:.4f} acc {acc:.3f} "
             f"lr {lr:.4g} {images / seconds:.0f} img/s "
             f"left {format_seconds(seconds / step * (steps - step))}")


def log_epoch(record: dict, epochs: int) -> None:
    log.info(f"epoch {record['epoch']}/{epochs} train_loss {record['train_loss']:.4f} "
             f"train_acc {record['train_acc']:.4f} val_loss {record['val_loss']:.4f} "
             f"val_acc {record['val_acc']:.4f} time {record['epoch_time_s']:.1f}s "
             f"{record['images_per_s']:.0f} img/s")


@torch.no_grad()
def broadcast_buffers(model: nn.Module) -> None:
    """Give every rank rank 0's batch-norm statistics, as DDP's next forward would."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        for buffer in unwrap(model).buffers():
            dist.broadcast(buffer, 0)


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device,
             autocast_dtype: torch.dtype | None = None,
             channels_last: bool = False) -> tuple[float, float, int]:
    """(loss, accuracy, images) over the whole validation set, each image counted once.

    Runs the unwrapped module: shards may differ in length by one batch, and
    DDP's forward could otherwise wait for a rank that has finished.
    """
    module = unwrap(model)
    broadcast_buffers(module)
    module.eval()
    meter = Meter(device)
    autocast = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype
                else nullcontext())
    for images, targets in loader:
        images = prepare_images(images, device, channels_last)
        targets = targets.to(device, non_blocking=True)
        with autocast:
            logits = module(images)
        loss = nn.functional.cross_entropy(logits.float(), targets)
        meter.update(loss, logits, targets)
    return meter.reduce()


# ----------------------------------------------------------- checkpoints ----

def save_checkpoint(state: dict, path: Path) -> None:
    """Write atomically: a crash mid-write leaves the previous checkpoint intact."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_checkpoint(path: Path) -> dict | None:
    """The checkpoint at path, or None if there is none; a clear error if it is broken."""
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # unpickling errors have many types
        raise UsageError(f"{path} is not a readable checkpoint ({first_line(e)}): "
                         f"delete it or use another --output-dir") from None
    if not isinstance(state, dict) or not {"model", "optimizer", "epoch"} <= state.keys():
        raise UsageError(f"{path} is not a checkpoint of these scripts: "
                         f"delete it or use another --output-dir")
    return state


def load_checkpoint_everywhere(path: Path, rank: int) -> dict | None:
    """Rank 0 reads the checkpoint and sends it to all ranks, so other nodes
    need no shared file system and every rank fails alike on a bad file."""
    state, error = None, ""
    if rank == 0:
        try:
            state = read_checkpoint(path)
        except UsageError as e:
            error = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [state, error]
        dist.broadcast_object_list(box, src=0)
        state, error = box
    if error:
        raise UsageError(error)
    return state


def restore(state: dict, model: nn.Module, path: Path, arch: str, **stateful) -> None:
    """Load weights and every other state (optimizer, scheduler, scaler) from a checkpoint."""
    if state.get("arch", arch) != arch:
        raise UsageError(f"{path} holds a {state['arch']} model, not --arch {arch}: "
                         f"use another --output-dir")
    try:
        unwrap(model).load_state_dict(state["model"])
        for name, obj in stateful.items():
            obj.load_state_dict(state[name])
    except (RuntimeError, KeyError, ValueError) as e:
        raise UsageError(f"{path} does not fit this model or these flags ({first_line(e)}): "
                         f"use another --output-dir") from None


def start_metrics(path: Path, completed_epochs: int) -> None:
    """Keep only the lines of epochs the checkpoint holds, so a rerun never logs an epoch twice."""
    lines = path.read_text().splitlines() if path.exists() else []
    kept = [line for line in lines if line.strip() and json.loads(line)["epoch"] <= completed_epochs]
    path.write_text("".join(line + "\n" for line in kept))


def append_metrics(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


class Timer:
    """Wall time since start, and the part of it spent waiting for data."""

    def __init__(self):
        self.start = time.perf_counter()
        self.data_wait = 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def timed(self, iterable):
        """Yield from iterable, adding the time each item took to arrive to data_wait."""
        iterator = iter(iterable)
        while True:
            t = time.perf_counter()
            try:
                item = next(iterator)
            except StopIteration:
                return
            self.data_wait += time.perf_counter() - t
            yield item
