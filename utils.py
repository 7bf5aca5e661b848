"""Small helpers shared by the five training scripts: what no approach owns (one-line errors, flags, logging,
meters, rendezvous, checkpoints, checks of a batch, model and loss, the built-in data and models). The DDP
recipe itself (samplers, loaders, wrap, step, evaluation, teardown) is in each script."""
from __future__ import annotations

import argparse, contextlib, errno, inspect, io, json, logging, math, os, re, resource, signal, socket, sys, tempfile
import time, uuid
from datetime import timedelta
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

import numpy as np

# PyTorch's C++ side logs rendezvous retries with stack dumps; our errors say it in one
# line. Must be set before torch loads; TORCH_CPP_LOG_LEVEL=INFO shows everything again.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
import torch  # noqa: E402
import torch.distributed as dist
import torch.nn as nn
import torchvision
import torch.utils.flop_counter
from torch.utils._pytree import tree_leaves, tree_map_only  # nested tuples, lists and dicts of tensors
from torch.utils.data import DataLoader, Dataset, TensorDataset

log = logging.getLogger("train")

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
FAKE_CLASSES = 10
FAKE_VAL_FRACTION = 5  # fake validation set = fake_size // 5 images


# ---------------------------------------------------------------- errors ----

class UsageError(Exception):
    """A mistake the user can fix: printed as one line, exit status 1."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag ends in one line, and --flag_name is accepted for --flag-name."""

    def error(self, message: str) -> None:
        sys.exit(f"{self.prog}: error: {message} (see --help)")

    def parse_known_args(self, args=None, namespace=None):
        return super().parse_known_args([self.kebab_case(a) for a in (sys.argv[1:] if args is None else args)],
                                        namespace)

    def kebab_case(self, arg: str) -> str:
        name, equals, value = arg.partition("=")
        known = arg.startswith("--") and name.replace("_", "-") in self._option_string_actions
        return name.replace("_", "-") + equals + value if known else arg


def build_parser(description: str) -> ArgumentParser:
    """The flags every script shares (../shared/CONTRACT.md); scripts add their own."""
    p = ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       epilog="Every flag may also be spelt with underscores: --batch_size 128.")
    add = p.add_argument
    add("--dataset", default="cifar100", choices=["cifar10", "cifar100", "imagefolder", "fake"],
        help="built-in data (fake: in memory, no files, no network)")
    add("--data-dir", default="./data", help="where data lives or is downloaded to")
    add("--no-download", action="store_true", help="fail instead of downloading missing CIFAR")
    add("--fake-size", type=int, default=50_000, help="training images of --dataset fake")
    add("--image-size", type=int, default=32, help="side of imagefolder and fake images")
    add("--no-augment", action="store_true", help="no random crops or flips (exact reproducibility checks)")
    add("--arch", default="resnet18", help="tiny, or a torchvision classifier name")
    add("--epochs", type=int, default=30, help="planned epochs (the lr schedule spans them)")
    add("--stop-after", type=int, default=None, metavar="N", help="end after N epochs; the same command continues")
    add("--batch-size", type=int, default=256, help="GLOBAL batch size, split evenly over all processes")
    add("--lr", type=float, default=None, help="peak learning rate (default: 0.1 x batch-size / 256)")
    add("--warmup", type=float, default=0.1, metavar="FRACTION", help="part of the steps the lr rises linearly")
    add("--momentum", type=float, default=0.9, help="SGD momentum")
    add("--weight-decay", type=float, default=5e-4, help="SGD weight decay")
    add("--workers", type=int, default=None, help="DataLoader workers per process (default: spare cores per GPU)")
    add("--seed", type=int, default=0, help="seed for init, data order and augmentation")
    add("--print-freq", type=int, default=50, help="log every N steps")
    add("--ip", default=None, help="rendezvous address for tcp:// init (default 127.0.0.1)")
    add("--port", type=int, default=None, help="rendezvous port for tcp:// init")
    add("--dist-url", default=None, help="env://, tcp://HOST:PORT or file:///shared/path (overrides --ip/--port)")
    add("--backend", choices=["nccl", "gloo"], default=None, help="default: nccl with CUDA, else gloo")
    add("--timeout", type=float, default=300, help="seconds before a stuck rendezvous or collective fails")
    add("--sync-bn", action="store_true", help="synchronise batch-norm statistics over GPUs")
    add("--channels-last", action="store_true", help="NHWC model and images (faster on Tensor Cores)")
    add("--compile", action="store_true", help="compile the model with torch.compile")
    add("--compile-mode", choices=["default", "reduce-overhead", "max-autotune"], help="implies --compile; "
        "reduce-overhead replays each step as CUDA graphs on GPUs")
    add("--output-dir", default="./output", help="where rank 0 writes checkpoint.pt and metrics.jsonl")
    add("--save-every", type=int, default=None, metavar="N", help="also save a checkpoint every N optimizer steps")
    add("--find-unused-parameters", action="store_true", help="DDP: train models with parameters that get "
        "no gradient in some steps (an extra pass over the graph every step)")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Catch impossible values before any process group or data is touched; fill machine defaults."""
    for name in ("epochs", "batch_size", "fake_size", "image_size", "print_freq", "stop_after", "save_every"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if (args.workers or 0) < 0 or args.timeout <= 0 or args.seed < 0 or not 0 <= args.warmup < 1:
        raise UsageError("--workers and --seed must be >= 0, --timeout > 0 and --warmup in [0, 1)")
    args.compile = args.compile or args.compile_mode is not None
    if args.lr is None:  # the linear scaling rule (Goyal et al. 2017): 0.1 per 256 images of global batch
        args.lr = 0.1 * args.batch_size / 256
    if args.workers is None:  # the cores each GPU can spare, one kept for the training loop itself
        gpus = torch.cuda.device_count()
        args.workers = min(8, max(0, (os.cpu_count() or 1) // gpus - 2)) if gpus else 0


def first_line(error: BaseException) -> str:
    """PyTorch's distributed errors append a C++ stack trace: keep line one."""
    return (str(error).strip() or type(error).__name__).splitlines()[0]


def failure_message(error: BaseException) -> str | None:
    """The one line to print for an error a user can cause; None for a bug (keep its traceback)."""
    if isinstance(error, UsageError):
        return f"error: {error}"
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return "error: out of GPU memory: lower --batch-size"
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    # gloo reports a dead peer or a timeout as a plain RuntimeError
    if isinstance(error, (dist.DistError, ConnectionError, TimeoutError)) or (isinstance(error, RuntimeError)
            and re.search(r"gloo|nccl|[Cc]onnection|[Tt]imed out|[Tt]imeout|peer", str(error))):
        return f"error: distributed communication failed: {first_line(error)}"
    return None


class Stopped(Exception):
    """Stopped by a signal after a step all ranks agreed on, and saved there."""

    def __init__(self, signum: int, epoch: int, step: int, steps: int):
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}/{steps} of epoch {epoch + 1}, "
                         f"saved: the same command continues from there")
        self.signum = signum


def run_main(main: Callable[[], None]) -> None:
    """Run main(); turn user errors into one line and a non-zero exit; always tear down."""
    try:
        main()
    except Stopped as e:
        print(e, file=sys.stderr, flush=True)
        sys.exit(128 + e.signum)  # as a shell reports a process ended by that signal
    except (Exception, KeyboardInterrupt) as e:
        if (message := failure_message(e)) is None:
            raise
        sys.exit(message)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


# --------------------------------------------------------------- logging ----

def setup_logging(rank: int) -> None:
    """Rank 0 prints progress; other ranks print warnings and errors only."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stdout, force=True,
                        format="%(message)s" if rank == 0 else f"[rank {rank}] %(message)s")


# ----------------------------------------------------------- distributed ----

def check_batch_size(batch_size: int, parts: int, what: str) -> int:
    """The batch of each of parts (described by what); a clear error if it does not split evenly."""
    if batch_size % parts or batch_size < parts:
        raise UsageError(f"--batch-size {batch_size} does not split evenly over {what}: use a multiple of {parts}")
    return batch_size // parts


def rendezvous_store(init_method: str | None, rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The key-value store where the processes meet, for init_process_group(store=...)."""
    if init_method is None:
        return dist.HashStore()  # a world of one needs no network
    url = urlparse(init_method)
    if url.scheme == "file":
        return dist.FileStore(url.path, world_size)
    if url.scheme == "env":
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun hosts the store
            agent_store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
            return fresh_namespace(agent_store, rank, world_size, timeout)
        url = urlparse(f"tcp://{host}:{port}")  # Slurm, or MASTER_ADDR set by hand
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


def fresh_namespace(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """A part of store no earlier group of this job wrote to: torchrun keeps it across worker restarts, whose count
    differs between nodes (PyTorch issue 135712). Rank 0 draws a generation and answers each rank's fresh token."""
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        generation, answered = store.add("ddp/generation", 1), set()
        while (joined := store.add(f"ddp/{generation}/joined", 0)) < world_size - 1:
            hellos = [f"ddp/hello/{r}" for r in range(1, world_size)]
            for token in set(store.multi_get([k for k in hellos if store.check([k])])) - answered:
                store.set(f"ddp/answer/{token.decode()}", str(generation))
                answered.add(token)
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {joined + 1} of {world_size} processes arrived within {timeout}")
            time.sleep(0.01)
    else:
        token = uuid.uuid4().hex
        store.set(f"ddp/hello/{rank}", token)
        generation = int(store.get(f"ddp/answer/{token}"))  # waits for rank 0's answer
        store.add(f"ddp/{generation}/joined", 1)
    return dist.PrefixStore(f"ddp/{generation}/", store)


def describe_init_error(error: Exception, init_method: str) -> str:
    """Turn a failed rendezvous into a line that says what to change."""
    text = first_line(error)
    if isinstance(error, (dist.DistStoreError, TimeoutError)) or re.search("timed out|timeout", text, re.I):
        return f"rendezvous at {init_method} timed out: is the address right and every process started? ({text})"
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




def no_buffer_sync_per_forward() -> dict[str, bool]:
    """DDP's keyword for no buffer broadcast before every forward (forward_sync_buffers since 2.14)."""
    params = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside DDP / DataParallel / torch.compile wrappers."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = model.module if hasattr(model, "module") else model._orig_mod
    return model


# --------------------------------------------------------- built-in data ----
# What the scripts' build_datasets() uses; a user's own Dataset replaces all of it.

def builtin_datasets(args) -> tuple[Dataset, Dataset, int]:
    """(train, val, classes) for --dataset: uint8 images with a batch_transform for the device."""
    if args.dataset == "fake":
        train = fake_images(args.fake_size, args.image_size, "train")
        val = fake_images(max(1, args.fake_size // FAKE_VAL_FRACTION), args.image_size, "val")
    elif args.dataset == "imagefolder":
        train, val = image_folders(Path(args.data_dir), args.image_size)
    else:
        train, val = cifar(args)
    train.batch_transform = ImageBatchTransform(args.seed, 0 if args.no_augment else args.image_size // 8)
    val.batch_transform = ImageBatchTransform(args.seed, padding=0)
    return train, val, len(train.classes)


class ImageTensors(TensorDataset):
    """A whole image set held as one uint8 tensor (N, 3, H, W), and its labels: CIFAR and fake data."""

    def __init__(self, images: np.ndarray, targets, classes: list[str]):
        super().__init__(torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(), torch.as_tensor(targets))
        self.classes = list(classes)


def fake_images(size: int, image_size: int, split: str, seed: int = 0) -> ImageTensors:
    """Learnable uint8 images held like CIFAR: a colour pattern per class, plus noise; fixed by (seed, split)."""
    patterns = np.random.default_rng(seed).integers(0, 256, (FAKE_CLASSES, 4, 4, 3)).astype(np.float32)
    repeat = math.ceil(image_size / 4)  # 4x4 blocks of colour, cut to the image size
    patterns = patterns.repeat(repeat, 1).repeat(repeat, 2)[:, :image_size, :image_size]
    rng = np.random.default_rng(seed * 10 + {"train": 1, "val": 2}[split])
    targets = rng.integers(0, FAKE_CLASSES, size)
    noise = rng.normal(0, 64, (size, image_size, image_size, 3)).astype(np.float32)
    images = np.clip(patterns[targets] * 0.6 + 50 + noise, 0, 255).astype(np.uint8)
    return ImageTensors(images, targets, [str(c) for c in range(FAKE_CLASSES)])


def image_folders(root: Path, image_size: int) -> tuple[Dataset, Dataset]:
    """DATA_DIR/train/<class>/* and DATA_DIR/val/<class>/*, brought to image_size, as uint8."""
    T = torchvision.transforms
    resize = T.Compose([T.Resize(image_size), T.CenterCrop(image_size), T.PILToTensor()])
    try:
        train, val = (torchvision.datasets.ImageFolder(str(root / s), resize) for s in ("train", "val"))
    except OSError as e:  # a missing folder, or one without images
        raise UsageError(f"images not found under {root} ({first_line(e)}): --dataset imagefolder reads "
                         f"DATA_DIR/train/<class>/* and DATA_DIR/val/<class>/*") from None
    if train.classes != val.classes:
        raise UsageError(f"{root}/train and {root}/val have different class folders")
    return train, val


def cifar(args) -> tuple[ImageTensors, ImageTensors]:
    """CIFAR-10 or -100, downloaded by one process per machine while the others wait; all fail alike."""
    cls = torchvision.datasets.CIFAR10 if args.dataset == "cifar10" else torchvision.datasets.CIFAR100
    with errors_shared_by_all_ranks():
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            try:  # one archive holds both splits
                cls(args.data_dir, download=not args.no_download)
            except (RuntimeError, OSError) as e:
                how = "--no-download was given" if args.no_download else "the download failed"
                raise UsageError(f"{args.dataset} not found in {args.data_dir} and {how} ({first_line(e)})") from None
    splits = (cls(args.data_dir, train=train) for train in (True, False))
    return tuple(ImageTensors(d.data, d.targets, d.classes) for d in splits)


class ImageBatchTransform:
    """Built-in uint8 images, a batch at a time on the device: random crop and flip (padding > 0), then normalised.
    The draws of a global batch come from (seed, epoch, step), and rank r keeps those of its images r, r+W, ...
    (DistributedSampler's order): 1 and W processes, and a resumed run, see identical inputs."""

    def __init__(self, seed: int, padding: int):
        self.seed, self.padding = seed, padding
        self.mean, self.std = (torch.tensor(v).view(1, 3, 1, 1) * 255 for v in (CIFAR_MEAN, CIFAR_STD))

    def __call__(self, images: torch.Tensor, key: tuple[int, int] | None = None) -> torch.Tensor:
        if self.padding and key is not None:
            rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
            seed = np.random.SeedSequence([self.seed, *key]).generate_state(1)[0]  # a stream per (seed, epoch, step)
            generator = torch.Generator().manual_seed(int(seed))
            shifts = torch.randint(0, 2 * self.padding + 1, (world * len(images), 2), generator=generator)
            flips = torch.randint(0, 2, (world * len(images),), generator=generator).bool()
            shifts, flips = shifts[rank::world].to(images.device), flips[rank::world].to(images.device)
            images = random_crop_flip(images, shifts[:, 0], shifts[:, 1], flips, self.padding)
        if self.mean.device != images.device:  # moved once, not every step
            self.mean, self.std = self.mean.to(images.device), self.std.to(images.device)
        return (images.float() - self.mean) / self.std


def random_crop_flip(images: torch.Tensor, top: torch.Tensor, left: torch.Tensor, flip: torch.Tensor,
                     padding: int) -> torch.Tensor:
    """RandomCrop(size, padding) at (top[i], left[i]), then a flip if flip[i], for a whole batch."""
    n, c, h, w = images.shape
    padded = nn.functional.pad(images, (padding,) * 4)
    rows = top.view(n, 1) + torch.arange(h, device=images.device)
    cols = left.view(n, 1) + torch.arange(w, device=images.device)
    cols = torch.where(flip.view(n, 1), cols.flip(1), cols)  # a flipped crop reads its columns backwards
    padded = padded.gather(2, rows.view(n, 1, h, 1).expand(n, c, h, w + 2 * padding))
    return padded.gather(3, cols.view(n, 1, 1, w).expand(n, c, h, w))


def batch_to_device(batch, device: torch.device, dataset: Dataset, channels_last: bool = False,
                    key: tuple[int, int] | None = None):
    """(inputs, targets) of any structure on the device; a dataset's batch_transform finishes the inputs there."""
    inputs, targets = tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), batch)
    transform = getattr(dataset, "batch_transform", None)
    if transform is not None:
        inputs = transform(inputs, key)
    if channels_last and isinstance(inputs, torch.Tensor) and inputs.dim() == 4:
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    return inputs, targets


# --------------------------------------------------- any batch, any task ----

def first(data, n: int):
    """The first n samples of a batch of any structure."""
    return tree_map_only(torch.Tensor, lambda t: t[:n], data)


def batch_len(data) -> int:
    """Samples in a batch of any structure: its first tensor's batch dimension."""
    return len(next(leaf for leaf in tree_leaves(data) if isinstance(leaf, torch.Tensor)))


def class_indices(outputs, targets) -> bool:
    """Are targets class indices for scores at outputs' dim 1 (classification, per-pixel classification)?"""
    return (isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor) and outputs.is_floating_point()
            and not (targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool)
            and outputs.dim() == targets.dim() + 1 and outputs.shape[:1] + outputs.shape[2:] == targets.shape)


def is_default_loss(compute_loss: Callable) -> bool:
    """Is compute_loss the scripts' default: F.cross_entropy of its arguments, with no other name or constant
    (an ignore_index=, a weight, a label_smoothing= would be one)?"""
    code = getattr(compute_loss, "__code__", None)
    return (code is not None and code.co_names == ("F", "cross_entropy")
            and set(code.co_consts) <= {None, compute_loss.__doc__})


# ------------------------------------------------------- built-in models ----

def builtin_model(arch: str, num_classes: int, image_size: int) -> nn.Module:
    """tiny, or any torchvision classifier; a clear line for one that cannot be built for image_size."""
    if arch == "tiny":  # GroupNorm (no batch statistics), GELU, no max-pool: world sizes agree to 1e-5
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, 1, 1), nn.GroupNorm(8, 16), nn.GELU(),
            nn.Conv2d(16, 32, 3, 2, 1), nn.GroupNorm(8, 32), nn.GELU(),
            nn.Conv2d(32, 64, 3, 2, 1), nn.GroupNorm(8, 64), nn.GELU(),
            nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(64 * 16, num_classes))  # 4x4 cells: where, not what
    if arch not in torchvision.models.list_models(module=torchvision.models):
        raise UsageError(f"unknown --arch {arch!r}: use tiny or a torchvision classifier such as resnet18, vit_b_16")
    try:
        return torchvision_model(arch, num_classes, image_size)
    except (AssertionError, ValueError, RuntimeError) as e:  # vit_b_16 at 40 px: "indivisible by patch size"
        raise UsageError(cannot_take(arch, image_size, e)) from None


def torchvision_model(arch: str, num_classes: int, image_size: int) -> nn.Module:
    """No auxiliary heads (googlenet, inception_v3): training uses one output; small images: a ResNet 3x3 stem."""
    extra = {"image_size": image_size} if arch.startswith("vit_") else {}
    if arch in ("googlenet", "inception_v3"):
        extra.update(aux_logits=False, init_weights=True)
    model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **extra)
    if image_size <= 64 and isinstance(model, torchvision.models.ResNet):
        # the ImageNet stem would shrink 32x32 inputs to 8x8 before the first block
        model.conv1 = nn.Conv2d(3, model.conv1.out_channels, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
    return model


def cannot_take(arch: str, image_size: int, error: Exception) -> str:
    """The line for a model that cannot take image_size, naming the smallest multiple of 8 that works."""
    line = f"--arch {arch} cannot take {image_size}x{image_size} images ({first_line(error)})"
    for size in range(image_size // 8 * 8 + 8, 520, 8):
        with contextlib.suppress(Exception), torch.no_grad():
            torchvision_model(arch, 2, size).eval()(torch.zeros(1, 3, size, size))
            return f"{line}: use --image-size {size} or another --arch"
    return f"{line}: use another --arch"


# ------------------------------------------------------------- metering ----

class Meter:
    """An epoch's sums (on the device; reduced when read) of loss x samples, correct and scored class targets,
    and samples; its time and data wait. Accuracy is scored where targets are class indices, else None."""

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)
        self.start, self.data_wait = time.perf_counter(), 0.0

    def update(self, loss: torch.Tensor, outputs, targets) -> None:
        n, correct, scored = batch_len(targets), self.sums.new_zeros(()), self.sums.new_zeros(())
        if class_indices(outputs, targets) and outputs.shape[1] > 1:
            valid = (targets >= 0) & (targets < outputs.shape[1])  # not a segmentation's "ignore" label
            correct, scored = ((outputs.argmax(1) == targets) & valid).sum(), valid.sum()
        self.sums += torch.stack([loss.detach().double() * n, correct.double(), scored.double(),
                                  self.sums.new_full((), n)])

    def reduce(self) -> tuple[float, float | None, int]:
        """(mean loss, accuracy or None, samples) over all ranks; a collective: call on every rank."""
        sums = self.sums.clone()
        if dist.is_initialized():
            dist.all_reduce(sums)  # a sum over ranks
        loss_sum, correct, scored, count = sums.tolist()
        return loss_sum / max(count, 1), correct / scored if scored else None, int(count)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def timed(self, iterable):
        """Yield from iterable, adding the time each item took to arrive to data_wait."""
        t = time.perf_counter()
        for item in iterable:
            self.data_wait += time.perf_counter() - t
            yield item
            t = time.perf_counter()


def log_progress(meter: Meter, epoch: int, step: int, steps: int, lr: float, args) -> None:
    """One progress line on rank 0 (a collective: every rank calls it at the same step); a diverged run stops."""
    loss, acc, samples = meter.reduce()
    check_finite(None, epoch, step, {"train_loss": loss}, args)
    seconds = meter.elapsed()
    log.info(f"epoch {epoch + 1}/{args.epochs} step {step}/{steps} loss {loss:.4f}"
             + (f" acc {acc:.3f}" if acc is not None else "") + f" lr {lr:.4g} {samples / seconds:.0f} img/s "
             f"left {timedelta(seconds=int(seconds / step * (steps - step)))}")


def log_epoch(record: dict, epochs: int) -> None:
    metrics = " ".join(f"{k} {record[k]:.4f}" for k in ("train_loss", "train_acc", "val_loss", "val_acc")
                       if record[k] is not None)
    log.info(f"epoch {record['epoch']}/{epochs} {metrics} time {record['epoch_time_s']:.1f}s "
             f"{record['images_per_s']:.0f} img/s")


def check_finite(model: nn.Module | None, epoch: int, step: int, record: dict | None, args) -> None:
    """A NaN or infinite loss or weight stops every rank, checked where the run reads them anyway: before a progress
    line (model None) or a save, so that nothing diverged is logged or written over a finite checkpoint."""
    losses = [value for key, value in (record or {}).items() if key.endswith("_loss")]
    if all(map(math.isfinite, losses)) and (model is None or all(p.isfinite().all() for p in model.parameters())):
        return
    where = f"by step {step} of epoch {epoch + 1}" if step else f"in epoch {epoch}"
    clip = ", or use --clip-grad" if hasattr(args, "clip_grad") else ""
    raise UsageError(f"training diverged: the loss or the weights became NaN or infinite {where}: lower --lr (peak "
                     f"{args.lr:.4g}) or lengthen --warmup ({args.warmup:g}){clip}; only finite checkpoints were saved")


def check_first_step(model: nn.Module, inputs, targets, compute_loss: Callable, dataset: Dataset, args,
                     unused_ok: bool) -> float:
    """A training step's forward and backward pass of two samples of a real batch (in float32: small, whatever the
    precision of training), undone, before training: what would fail or learn nothing later ends every rank here
    with one line, and the first batch's labels are checked. Returns the FLOPs per sample."""
    with errors_shared_by_all_ranks():  # one rank's bad batch ends every rank with its line
        buffers = [b.clone() for b in model.buffers()]  # batch-norm statistics, put back afterwards
        rng_devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(rng_devices), torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
            try:
                outputs = model.train()(first(inputs, 2))
            except (RuntimeError, ValueError, AssertionError, TypeError, IndexError) as e:
                if hasattr(dataset, "batch_transform"):  # built-in images and models: name a size that works
                    raise UsageError(cannot_take(args.arch, args.image_size, e)) from None
                raise UsageError(f"the model cannot take the first batch's inputs: {first_line(e)}") from None
            if is_default_loss(compute_loss):  # on a GPU a bad label is a device-side assert that kills the process
                check_class_targets(outputs, targets)
            loss = compute_loss(outputs, first(targets, 2))
            if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
                what = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise UsageError(f"compute_loss must return a scalar tensor, not {what}: reduce it, e.g. with .mean()")
            loss.backward()
        unused = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
        model.zero_grad(set_to_none=True)
        for buffer, saved in zip(model.buffers(), buffers):
            buffer.copy_(saved)
        if unused and not unused_ok:
            names = ", ".join(unused[:3]) + (", ..." if len(unused) > 3 else "")
            raise UsageError(f"{len(unused)} parameters get no gradient ({names}): --find-unused-parameters lets DDP "
                             f"train such a model, or leave them out of it")
    return counter.get_total_flops() / batch_len(first(inputs, 2))


def check_class_targets(outputs, targets) -> None:
    """The first batch's targets that the default loss, cross-entropy over outputs' dim 1, cannot mean."""
    classes = outputs.shape[1] if isinstance(outputs, torch.Tensor) and outputs.dim() > 1 else 0
    if classes == 1:
        raise UsageError("the model gives 1 output per sample, and cross-entropy over one class is always 0: "
                         "check num_classes, or replace compute_loss (a regression: F.mse_loss)")
    if classes and isinstance(targets, torch.Tensor) and not targets.is_floating_point():  # class indices
        low, high = int(targets.min()), int(targets.max())
        if low < 0 or high >= classes:
            raise UsageError(f"class labels from {low} to {high} in the first batch, outside [0, {classes}) for "
                             f"the model's {classes} outputs: check num_classes, or replace compute_loss")


def peak_memory_mb(device: torch.device) -> float:
    """Peak GPU memory allocated by this process, or its peak resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# ------------------------------------------------- checkpoints and metrics ----

def warmup_cosine(optimizer: torch.optim.Optimizer, steps: int, warmup: float) -> torch.optim.lr_scheduler.LambdaLR:
    """A linear rise over the first `warmup` part of `steps`, then a cosine decay to 0; stepped per step."""
    rise = max(1, round(warmup * steps))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (step + 1) / rise if step < rise else
                                             0.5 * (1 + math.cos(math.pi * (step - rise) / max(1, steps - rise))))


class StopSignal:
    """Notes SIGTERM and SIGUSR1 (preemption, Slurm's --signal) instead of dying at once."""

    def __init__(self):
        self.signal = 0
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(signum, lambda received, frame: setattr(self, "signal", received))
        gpus = dist.is_initialized() and dist.get_backend() != "gloo"  # then check on the CPU: no GPU sync
        self.group = dist.new_group(backend="gloo") if gpus else None

    def agreed(self) -> int:
        """The signal any rank got, or 0, so that all stop after the same step; every rank calls it every step."""
        flag = torch.tensor(self.signal)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag)


@contextlib.contextmanager
def errors_shared_by_all_ranks():
    """A block that reads or writes files: its OSError (a full disk) or UsageError ends every rank with one line."""
    error = ""
    try:
        yield
    except UsageError as e:
        error = str(e)
    except OSError as e:  # a failed write() names no file: then the directory it was in
        error = (f"cannot write {e.filename or 'in --output-dir'}: {e.strerror or e}: free space or use "
                 f"another --output-dir")
    errors = [error] * (dist.get_world_size() if dist.is_initialized() else 1)
    if len(errors) > 1:
        dist.all_gather_object(errors, error)
    if any(errors):
        raise UsageError(next(e for e in errors if e))


def check_output_dir(path: Path) -> None:
    """Create the output directory and prove that it takes a file, before any data or model is built."""
    path.mkdir(parents=True, exist_ok=True)
    tempfile.TemporaryFile(dir=path).close()


def save_checkpoint(state: dict, path: Path) -> None:
    """Write atomically: a crash or a full disk mid-write leaves the previous checkpoint and no temporary file."""
    buffer = io.BytesIO()
    torch.save(state, buffer)  # in memory first: torch.save reports a failed file write as a C++ error
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror, str(path)) from None


def skip_batches(loader: DataLoader, batches: int) -> DataLoader:
    """The loader without its first batches, in its sampler's order: a run continued mid-epoch."""
    indices = list(loader.sampler)[batches * loader.batch_size:]
    return DataLoader(loader.dataset, loader.batch_size, sampler=indices, drop_last=loader.drop_last,
                      num_workers=loader.num_workers, pin_memory=loader.pin_memory, generator=loader.generator)


def load_checkpoint_everywhere(path: Path, rank: int) -> dict | None:
    """The checkpoint at path or None; rank 0 reads it and sends it to all (no shared file system needed)."""
    state = None
    with errors_shared_by_all_ranks():
        if rank == 0 and path.exists():
            try:
                state = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:  # unpickling errors have many types
                raise UsageError(f"{path} is not a readable checkpoint ({first_line(e)}): delete it or use "
                                 f"another --output-dir") from None
            if not (isinstance(state, dict) and {"model", "optimizer", "epoch"} <= state.keys()):
                raise UsageError(f"{path} is not a checkpoint of these scripts: delete it or use another --output-dir")
    box = [state]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def rng_states() -> dict:
    """The global random streams (dropout's; alike on all ranks): a continued run draws what a straight one would."""
    cuda = {"cuda_rng": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {}
    return {"rng": torch.get_rng_state(), **cuda}


def restore(state: dict, model: nn.Module, path: Path, arch: str, **stateful) -> None:
    """Load weights and every other state (optimizer, scheduler, scaler) from a checkpoint."""
    if state.get("arch", arch) != arch:
        raise UsageError(f"{path} holds a {state['arch']} model, not --arch {arch}: use another --output-dir")
    try:
        unwrap(model).load_state_dict(state["model"])
        for name, obj in stateful.items():
            obj.load_state_dict(state[name])
        torch.set_rng_state(state.get("rng", torch.get_rng_state()))
        if "cuda_rng" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda_rng"])
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
