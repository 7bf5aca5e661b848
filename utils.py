"""What every training script needs and no approach owns: each script holds its recipe,
builtin.py the demo data.

Copy it beside your script with stalls.py (the watchdog every script starts); streams.py too
where your data is a stream (an IterableDataset). Your project has a utils.py already? Save this
one under a name of its own (ddp_utils.py), imported as `import ddp_utils as utils` in the script,
stalls.py, streams.py and builtin.py (README.md, "Your project in four functions", has the sed).

Its sections, in this order:
- flags and errors: the flags every script shares (build_parser, check_args), UsageError, and
  run_main, which ends every error of ours or a library's in one line (error_line; raised_in tells
  them from the user's own, which keep their traceback);
- logging: rank 0 prints progress, the other ranks warnings;
- distributed: joining the group (rendezvous_store, fresh_namespace, describe_init_error),
  all_reduce, all_gather_objects, gather_on_rank_0, unwrap, local_shard;
- progress: what the run tells a watcher (progress.batch, progress.writing), and which frames are
  the user's (user_frame);
- PyTorch's insides we reach: every private name of PyTorch the files use, in one place;
- any batch, any task: Counted (samples per batch), forward, loss_for_backward, logits,
  class_indices;
- data: batch_to_device, steps_per_epoch, epoch_loader, first_samples;
- metering and records: Sums, Meter, StepRecords (steps.jsonl) and its sinks (TensorBoardSink,
  WandbSink), format_record, memory_mb;
- checks: one line for what would fail: check_finite, check_first_step, check_loss,
  check_class_targets;
- optimizer, schedule, weight average: build_optimizer, warmup_cosine, EMA;
- stops, checkpoints and metrics: StopSignal, errors_shared_by_all_ranks, checkpoints written
  atomically and sent a tensor at a time, restore, save_pretrained, append_metrics.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import errno
import functools
import gc
import importlib
import inspect
import itertools
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import pickle
import re
import resource
import shutil
import signal
import socket
import sys
import sysconfig
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from collections.abc import Callable, Mapping
from urllib.parse import urlparse

# PyTorch's C++ side logs rendezvous retries with stack dumps; our errors say it in one
# line. Must be set before torch loads; TORCH_CPP_LOG_LEVEL=INFO shows everything again.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
# a rank that ends at once (an error, a stall) leaves its forkserver workers' named semaphores to
# the resource tracker, which frees them, and would warn about each run on stderr
if "ignore:resource_tracker" not in os.environ.get("PYTHONWARNINGS", ""):
    os.environ["PYTHONWARNINGS"] = ",".join(
        filter(None, [os.environ.get("PYTHONWARNINGS"), "ignore:resource_tracker"])
    )
import torch  # noqa: E402
import torch.distributed as dist
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.data import DataLoader, Dataset

# PyTorch 2.8 or newer: on an older one a gloo process group could hang at exit (PyTorch PR
# 154976), and a listening socket failed the tcp:// store. 2.8.0a0 (a container's build) is 2.8.
if tuple(map(int, torch.__version__.split(".")[:2])) < (2, 8):
    sys.exit(
        f"error: the scripts need PyTorch 2.8 or newer, not {torch.__version__}: pip install -r"
        " requirements.txt"
    )

log = logging.getLogger("train")


# ------------------------------------------------------ flags and errors ----


class UsageError(Exception):
    """A mistake the user can fix: printed as one line, exit status 1."""

    def __str__(self) -> str:
        text = super().__str__()
        # One raised in a DataLoader worker (a file that cannot be read) comes with the worker's
        # traceback, its own line last.
        if text.startswith("Caught UsageError in DataLoader worker"):
            return text.rsplit("UsageError: ", 1)[-1].strip()
        return text


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


def build_parser(description: str) -> ArgumentParser:
    """The flags every script shares (../shared/CONTRACT.md); scripts add their own."""
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
        help="cut epochs at N steps (a stream without len)",
    )
    add(
        "--stop-after",
        type=int,
        default=None,
        metavar="N",
        help="end after N epochs; the same command continues",
    )
    add(
        "--batch-size",
        type=int,
        default=256,
        help="GLOBAL batch size, split evenly over all processes",
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
        help="clip the gradients' global norm to NORM",
    )
    add(
        "--workers",
        type=int,
        default=None,
        help="DataLoader workers per process (default: spare cores per GPU)",
    )
    add("--seed", type=int, default=0, help="seed for init, data order and augmentation")
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
        help="rank 0 also logs the records to a Weights & Biases run",
    )
    add(
        "--ema",
        type=float,
        metavar="DECAY",
        help="also validate and save a moving average of the weights (0.999)",
    )
    add("--ip", default=None, help="rendezvous address for tcp:// init (default 127.0.0.1)")
    add("--port", type=int, default=None, help="rendezvous port for tcp:// init")
    add(
        "--dist-url",
        default=None,
        help="env://, tcp://HOST:PORT or file:///shared/path (overrides --ip/--port)",
    )
    add(
        "--backend",
        choices=["nccl", "gloo"],
        default=None,
        help="default: nccl with CUDA, else gloo",
    )
    add(
        "--timeout",
        type=float,
        default=300,
        help=(
            "seconds before a stuck rendezvous fails, or a stalled rank ends every rank, named:"
            " from the first step, no batch or saved byte on any rank for S seconds; before it, a"
            " rank that another waited S seconds for (start-up work itself has no bound)"
        ),
    )
    add("--sync-bn", action="store_true", help="synchronise batch-norm statistics over GPUs")
    add(
        "--channels-last",
        action="store_true",
        help="NHWC model and images (faster on Tensor Cores)",
    )
    add("--compile", action="store_true", help="compile the model with torch.compile")
    add(
        "--compile-mode",
        choices=["default", "reduce-overhead", "max-autotune"],
        help="implies --compile",
    )
    add(
        "--output-dir",
        default="./output",
        help="where rank 0 writes checkpoint.pt and metrics.jsonl",
    )
    add(
        "--save-every",
        type=int,
        default=None,
        metavar="N",
        help="also save a checkpoint every N optimizer steps",
    )
    add(
        "--find-unused-parameters",
        action="store_true",
        help="DDP: allow parameters without a gradient in some steps",
    )
    add(
        "--comm-hook",
        choices=["bf16"],
        default=None,
        help=(
            "DDP: all-reduce the gradients in bfloat16, half the bytes (PyTorch's"
            " bf16_compress_hook)"
        ),
    )
    return p


def check_args(args: argparse.Namespace) -> None:
    """Catch impossible values before any process group or data is touched; fill machine
    defaults."""
    at_least_one = "epochs batch_size fake_size image_size print_freq eval_every stop_after"
    for name in f"{at_least_one} save_every steps_per_epoch".split():
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if (args.workers is not None and args.workers < 0) or args.seed < 0:
        raise UsageError("--workers and --seed must be >= 0")
    if args.timeout <= 0 or (args.clip_grad is not None and args.clip_grad <= 0):
        raise UsageError("--timeout and --clip-grad must be > 0")
    if not 0 <= args.warmup < 1:
        raise UsageError("--warmup must be in [0, 1)")
    if args.ema is not None and not 0 <= args.ema < 1:
        message = "the average spans about 1 / (1 - DECAY) steps"
        raise UsageError(f"--ema {args.ema:g} is not in [0, 1): {message}")
    if args.compile_mode is not None:
        args.compile = True
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
        args.workers = 0
        if gpus:
            args.workers = min(8, max(0, (os.cpu_count() or 1) // gpus - 2))


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
    # Below utils' frames: in the user's collate or model, not the script's call.
    ours = [i for i, frame in enumerate(frames) if frame.filename == __file__]
    below = frames[ours[-1] + 1 :] if ours else frames
    frame = user_frame(below)
    if frame is None:
        return ""
    return f", at {frame.name} ({Path(frame.filename).name}:{frame.lineno})"


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
    failing at once could run together."""
    sys.stderr.write(f"{line}\n")


# Where a run's last line goes: stderr, or distributed_mp.py's parent (run_main's say).
say_line: Callable[[str], object] = write_line


def run_main(main: Callable[[], None], say: Callable[[str], object] = write_line) -> None:
    """Run main(); a user's error ends in one line, said (printed, or sent to distributed_mp.py's
    parent), and exit status 1."""
    global say_line
    say_line = say
    exit_code = 0
    line = None
    try:
        main()
    except Stopped as e:
        sys.stderr.write(f"{e}\n")
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
            # A bug, the user's or ours: its traceback, then os._exit below (no exit that waits
            # on DataLoader workers).
            traceback.print_exc()
            exit_code = 1
    finally:
        # After the except blocks, whose exception kept main's frames (the model, DDP, FSDP)
        # alive. A watchdog ending the run (this error followed from the stall) ends it alone.
        progress.close()
        # W&B's records on disk before os._exit below.
        wandb = sys.modules.get("wandb")
        if wandb is not None and wandb.run is not None:
            wandb.finish(exit_code=int(exit_code != 0 or line is not None))
        # Free them and their process groups while the interpreter is whole.
        gc.collect()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if line is not None:
        say(line)
        exit_code = 1
    # All written or said: end without the interpreter's shutdown, where gloo's threads still abort
    # about one 2-process run in 50 on PyTorch 2.14 ("terminate called without an active
    # exception"), after an error too.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def error_line(error: Exception) -> str | None:
    """The one line for an error the user can act on that is not theirs to debug: a file of ours
    missing, a DataLoader worker killed, a failed collective. None for any other (a bug, the
    user's or ours), which keeps its traceback."""
    # A file of ours that the script reaches only when needed: a stream needs streams.py.
    if isinstance(error, ModuleNotFoundError):
        if error.name in ("streams", "builtin"):
            script = Path(sys.argv[0]).name
            return f"error: {error.name}.py is missing: copy it beside {script} and utils.py"
        return None
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
    in_torch = raised_in(error, str(Path(torch.__file__).parent), __file__)
    if isinstance(error, dist.DistError) or (in_torch and re.search(words, text)):
        return f"error: distributed communication failed: {first_line(error)}"
    return None


# --------------------------------------------------------------- logging ----


def setup_logging(rank: int) -> None:
    """Rank 0 prints progress; the other ranks print warnings and errors only."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        stream=sys.stdout,
        force=True,
        format="%(message)s" if rank == 0 else f"[rank {rank}] %(message)s",
    )


# ----------------------------------------------------------- distributed ----


def check_batch_size(batch_size: int, parts: int, what: str) -> int:
    """The batch of each of parts (described by what); a clear error if it does not split evenly."""
    if batch_size % parts or batch_size < parts:
        raise UsageError(
            f"--batch-size {batch_size} does not split evenly over {what}: use a multiple of"
            f" {parts}"
        )
    return batch_size // parts


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
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun hosts the store
            agent_store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
            return fresh_namespace(agent_store, rank, world_size, timeout)
        url = urlparse(f"tcp://{host}:{port}")  # Slurm, or MASTER_ADDR set by hand
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        raise UsageError(f"cannot use {init_method}: give env://, tcp://HOST:PORT or file:///PATH")
    # Rank 0 listens on the given address only: TCPStore alone would listen on every interface.
    listen_fd = None
    if rank == 0:
        try:
            listen_fd = socket.create_server((url.hostname, url.port)).detach()
        except OSError as e:
            reason = f"{e.strerror}; the address must be one of this machine (node 0)"
            if e.errno == errno.EADDRINUSE:
                reason = "the port is in use; choose another --port"
            where = f"tcp://{url.hostname}:{url.port}"
            raise UsageError(f"cannot listen on {where}: {reason}") from None
    return dist.TCPStore(
        url.hostname,
        url.port,
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        master_listen_fd=listen_fd,
    )


def fresh_namespace(
    store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta
) -> dist.Store:
    """A part of store no earlier group of this job wrote to: rank 0 draws a generation and
    answers each rank's token with it."""
    # torchrun keeps its store across worker restarts, whose count differs between nodes (PyTorch
    # issue 135712).
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


def describe_init_error(error: Exception, init_method: str) -> str:
    """Turn a failed rendezvous into a line that says what to change."""
    text = first_line(error)
    timed_out = re.search("timed out|timeout", text, re.I) is not None
    if isinstance(error, (dist.DistStoreError, TimeoutError)) or timed_out:
        return (
            f"rendezvous at {init_method} timed out: is the address right and every process"
            f" started? ({text})"
        )
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
    prefix, ranges = match.groups()  # node, 01-04
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def no_buffer_sync_per_forward() -> dict[str, bool]:
    """DDP's keyword for no buffer broadcast before every forward (forward_sync_buffers since
    2.14)."""
    params = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    if "forward_sync_buffers" in params:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """tensor, in place, summed (or op) over all ranks; as it is in a world of one."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def world_size() -> int:
    """The processes of the run: 1 without a process group."""
    if dist.is_initialized():
        return dist.get_world_size()
    return 1


def all_gather_objects(obj, group=None) -> list:
    """Every rank's obj, in rank order (a collective); [obj] in a world of one."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    objects = [None] * dist.get_world_size(group)
    dist.all_gather_object(objects, obj, group=group)
    return objects


def gather_on_rank_0(obj) -> list | None:
    """Every rank's obj, its tensors copied to the CPU, on rank 0 alone (a collective)."""
    obj = tree_map_only(torch.Tensor, to_cpu, obj)
    if world_size() == 1:
        return [obj]
    objects = None
    if dist.get_rank() == 0:
        objects = [None] * dist.get_world_size()
    dist.gather_object(obj, objects, dst=0)
    return objects


def to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu()


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside DDP, DataParallel and torch.compile wrappers."""
    inner = getattr(model, "module", getattr(model, "_orig_mod", None))
    if inner is None:
        return model
    return unwrap(inner)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: its shard of an FSDP parameter (a DTensor), else the tensor
    itself."""
    if hasattr(tensor, "to_local"):
        return tensor.to_local()
    return tensor


# -------------------------------------------------------------- progress ----


class Progress:
    """What the run tells a watcher of its progress: a batch arrived, a save is writing. This one
    does nothing; stalls.Watchdog, which ends a stalled run, takes its place (utils.progress =
    ...)."""

    def batch(self, key: tuple[int, int] | None) -> None:
        """A batch arrived: of training, key (epoch, step); of validation, key None."""

    @contextlib.contextmanager
    def writing(self, path: Path, growing: Path | None = None):
        """A save writes path within; growing is the file or folder that grows meanwhile."""
        yield

    def close(self) -> None:
        """The run has ended."""


progress = Progress()

# The files of the standard library and installed packages, torch's wherever it is installed.
LIBRARIES = tuple(
    {
        *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")),
        str(Path(torch.__file__).parents[1]),
    }
)
# This file and the optional ones beside it: ours, not the user's.
OURS = (
    __file__,
    str(Path(__file__).with_name("stalls.py")),
    str(Path(__file__).with_name("streams.py")),
)


def user_frame(frames: list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost frame of the user's code or the script (one of ours if none): not a
    library's."""
    not_libraries = [f for f in frames if not f.filename.startswith((*LIBRARIES, "<"))]
    for frame in reversed(not_libraries):
        if frame.filename not in OURS:
            return frame
    if not_libraries:
        return not_libraries[-1]
    return None


# -------------------------------------------- PyTorch's insides we reach ----
# Every private name of PyTorch or Python's multiprocessing that the scripts, utils.py and stalls.py
# use is reached here alone. tests/test_internals.py checks that each exists on the installed
# PyTorch, so an upgrade that renames one fails that test, not a user's run; where one is missing
# all the same, what it serves says so (the stall line names no rank) instead of going wrong.

# Nested tuples, lists and dicts of tensors, mapped and flattened: PyTorch's own tree utilities,
# which torch.compile and FSDP use too.
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

# The frame of a DataLoader waiting for a worker, and of a worker's loop.
DATALOADER_WAIT = "_try_get_data"
WORKER_LOOP = "_worker_loop"
# The files of a compile (not torch._dynamo's disable wrapper, which much of torch runs through).
COMPILE_FILES = re.compile(r"torch/_dynamo/convert_frame\.py|torch/_inductor/")


def collectives_started() -> int | None:
    """The collectives this rank has started in all its groups (the rank with fewest is the one the
    others wait for), or None where PyTorch no longer tells."""
    try:
        groups = dist.distributed_c10d._world.pg_map
        return sum(group._get_sequence_number_for_group() for group in groups)
    except (AttributeError, RuntimeError):
        return None


def default_store() -> dist.Store | None:
    """The store the default process group met in, or None where PyTorch no longer tells."""
    get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get_store is None:
        return None
    return get_store()


def nccl_trace() -> bytes | None:
    """NCCL's Flight Recorder trace of this rank's last collectives, or None."""
    try:
        return torch._C._distributed_c10d._dump_nccl_trace()
    except Exception:  # missing, or failing: the stall line must come all the same
        return None


def free_cached_host_memory() -> None:
    """Give back the pinned host memory CUDA keeps cached (a sharded save copies through it)."""
    empty_cache = getattr(torch._C, "_host_emptyCache", None)
    if empty_cache is not None:
        empty_cache()


def checkpoint_activations(module: nn.Module) -> None:
    """Recompute module's activations in backward: FSDP2's composable checkpoint, hooks rather than
    a wrapper module, so that the state dict's keys stay plain."""
    from torch.distributed._composable import checkpoint

    checkpoint(module)


def loss_scale(scaler: torch.amp.GradScaler) -> torch.Tensor:
    """A GradScaler's scale as a tensor on the device (get_scale() would wait for the device)."""
    return scaler._scale


def start_forkserver(folders: list[str]) -> None:
    """Start multiprocessing's forkserver now, finding the modules it preloads in folders."""
    # It reads PYTHONPATH, not sys.path, whatever the working directory.
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([*folders, *([path] if path else [])])
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if path is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = path


# --------------------------------------------------- any batch, any task ----


class Counted(functools.partial):
    """Counted(collate): a collate_fn giving (samples, batch), any batch counted as its samples;
    picklable."""

    def __call__(self, samples: list) -> tuple[int, object]:
        return len(samples), super().__call__(samples)


def forward(model: nn.Module, inputs):
    """A dict of inputs as keyword arguments, as Hugging Face models take them; anything else as
    one argument."""
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(inputs)


def loss_for_backward(loss) -> torch.Tensor:
    """compute_loss's mean as it is; its (sum, count) as sum x world size / all ranks' count (one
    small all-reduce): DDP and FSDP average the ranks' gradients, so that this is the gradient of
    the mean over every rank's items, whatever each rank's count."""
    if isinstance(loss, torch.Tensor):
        return loss
    total, count = loss
    count = all_reduce(torch.as_tensor(count, dtype=torch.float64, device=total.device).clone())
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


# ------------------------------------------------------------------ data ----


def batch_to_device(
    batch,
    device: torch.device,
    dataset: Dataset,
    channels_last: bool = False,
    key: tuple[int, int] | None = None,
):
    """(inputs, targets) of any structure on the device; a dataset's batch_transform finishes the
    inputs there (the built-in images' fast path). Each call is progress: key is (epoch, step) for
    a training batch, None for a validation one."""
    progress.batch(key)
    inputs, targets = batch
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
    return tensor.to(device, non_blocking=True)


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
    if args.steps_per_epoch:
        return min(batches, args.steps_per_epoch)
    return batches


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
    # A stream's sampler (streams.py) reads them from the stream.
    if hasattr(loader.sampler, "first"):
        return loader.sampler.first(n)
    # A share of nothing (a validation sampler with no index) takes the first of the set.
    indices = loader.sampler or range(len(loader.dataset))
    return [loader.dataset[i] for i in itertools.islice(indices, n)]


# -------------------------------------------------- metering and records ----


@dataclasses.dataclass
class Sums:
    """Sums over batches, in the order of the float64 tensor they travel in (one all-reduce)."""

    loss: float  # of the loss over its items
    items: float  # what the loss is a mean over: samples, or a (sum, count) loss's count
    correct: float  # class targets scored right
    scored: float  # class targets scored
    samples: float

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Sums:
        return cls(*tensor.tolist())

    def mean_loss(self) -> float:
        return self.loss / max(self.items, 1)

    def accuracy(self) -> float | None:
        """None where no target was a class index."""
        if not self.scored:
            return None
        return self.correct / self.scored


SUMS = len(dataclasses.fields(Sums))


def zero_sums(device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.zeros(SUMS, dtype=torch.float64, device=device)


class Meter:
    """An epoch's Sums on this rank, its time, and how long this rank waited for its data."""

    def __init__(self, device: torch.device, saved: dict | None = None, rank: int = 0):
        # Continued mid-epoch, rank 0 holds what all ranks had summed at the checkpoint, and what
        # the last record had read, so the records go on as before.
        self.before = zero_sums()
        self.recorded = zero_sums()
        if saved is not None:
            self.before = saved["sums"]
            self.recorded = saved["recorded"]
        self.sums = zero_sums(device)
        if rank == 0:
            self.sums += self.before.to(device)
        self.start = time.perf_counter()
        # The line of a batch read() could not read.
        self.error = ""
        self.data_wait = 0.0
        self.data_wait_recorded = 0.0
        # Whether the loss is a (sum, count) pair, whose items/s the records show too.
        self.pairs = False
        # When, and at which sums, the last record read the speed.
        self.marked_at = self.start
        self.marked_sums = self.before

    def update(self, loss, outputs, targets, samples: int) -> None:
        """Add a batch: its loss (a mean, or a (sum, count) pair), and its accuracy where the
        targets are class indices."""
        self.pairs = not isinstance(loss, torch.Tensor)
        if self.pairs:
            total, items = loss
        else:
            total = loss * samples
            items = samples
        correct = self.sums.new_zeros(())
        scored = self.sums.new_zeros(())
        scores = logits(outputs)
        if class_indices(scores, targets) and scores.shape[1] > 1:
            # A segmentation's "ignore" label is no class.
            valid = (targets >= 0) & (targets < scores.shape[1])
            correct = ((scores.argmax(1) == targets) & valid).sum()
            scored = valid.sum()
        values = (total.detach(), items, correct, scored, samples)
        device = self.sums.device
        self.sums += torch.stack(
            [torch.as_tensor(v, dtype=torch.float64, device=device) for v in values]
        )

    def read(self, loader):
        """The loader's batches, up to one this rank cannot read (a bad file: a UsageError), whose
        line all_ranks() then ends every rank with."""
        try:
            yield from loader
        except UsageError as e:
            self.error = str(e)

    def all_ranks_sums(self) -> torch.Tensor:
        """The sums over all ranks, on the CPU; where a rank could not read a batch, every rank
        ends with its line. A collective: every rank calls it at the same step."""
        failed = self.sums.new_tensor([float(bool(self.error))])
        both = all_reduce(torch.cat([self.sums, failed])).cpu()
        if both[SUMS]:
            raise UsageError(next(e for e in all_gather_objects(self.error) if e))
        # In a tensor of their own, which a checkpoint keeps as it is.
        return both[:SUMS].clone()

    def all_ranks(self) -> Sums:
        """The sums over all ranks (a collective)."""
        return Sums.of(self.all_ranks_sums())

    def since_record(self) -> dict:
        """Loss, accuracy and speed since the last record (items/s of a (sum, count) loss too),
        and the longest wait of a rank for its data and that rank (the slow one); a collective."""
        rank = 0
        if dist.is_initialized():
            rank = dist.get_rank()
        waits = torch.zeros(world_size(), dtype=torch.float64, device=self.sums.device)
        # Each rank its own place: the sum holds every rank's wait exactly.
        waits[rank] = self.data_wait - self.data_wait_recorded
        # One collective for both; the sums apart after it, in a tensor of their own that a
        # checkpoint keeps as it is.
        both = all_reduce(torch.cat([self.sums, waits])).cpu()
        now = both[:SUMS].clone()
        waits = both[SUMS:].clone()
        seconds = time.perf_counter() - self.marked_at
        since = Sums.of(now - self.recorded)
        moved = Sums.of(now - self.marked_sums)
        self.recorded = now
        self.marked_at = time.perf_counter()
        self.marked_sums = now
        self.data_wait_recorded = self.data_wait
        record = dict(
            train_loss=since.mean_loss(),
            train_acc=since.accuracy(),
            images_per_s=moved.samples / seconds,
        )
        if self.pairs:
            record["items_per_s"] = moved.items / seconds
        record["data_wait_max_s"] = waits.max().item()
        record["data_wait_rank"] = int(waits.argmax())
        return record

    def epoch_record(self) -> dict:
        """The epoch's loss and accuracy over all ranks (a collective), its time and this run's
        speed."""
        totals = self.all_ranks()
        seconds = time.perf_counter() - self.start
        samples = totals.samples - Sums.of(self.before).samples
        return dict(
            train_loss=totals.mean_loss(),
            train_acc=totals.accuracy(),
            epoch_time_s=seconds,
            images_per_s=samples / seconds,
            data_wait_s=self.data_wait,
        )

    def timed(self, iterable):
        """Yield from iterable, adding the time each item took to arrive to data_wait."""
        asked = time.perf_counter()
        for item in iterable:
            self.data_wait += time.perf_counter() - asked
            yield item
            asked = time.perf_counter()


class TensorBoardSink:
    """--tensorboard: each training and validation record's values at their global step in
    OUTPUT_DIR/tensorboard/; a continued run's events purge the steps after its checkpoint."""

    def __init__(self, directory: Path, first_step: int):
        # Imported only when asked for: torch.utils.tensorboard imports tensorboard.
        tensorboard = importlib.import_module("torch.utils.tensorboard")
        self.writer = tensorboard.SummaryWriter(directory, purge_step=first_step)

    def log_step(self, values: dict, global_step: int) -> None:
        for key, value in values.items():
            if value is not None:
                self.writer.add_scalar(key, value, global_step)
        # On disk before a later checkpoint: a kill loses no point the checkpoint keeps.
        self.writer.flush()

    def log_epoch(self, record: dict, global_step: int) -> None:
        """The epochs' lines stay in metrics.jsonl: their values are in the steps' records."""


class WandbSink:
    """--wandb: every record a row of a Weights & Biases run, plotted against its global_step (not
    W&B's own count); the epochs' lines at their last step, under epoch/. A continued run is the
    same run: its id is kept in the checkpoint."""

    def __init__(self, project: str, run_id: str, config: dict, directory: Path):
        wandb = importlib.import_module("wandb")
        try:
            self.run = wandb.init(
                project=project, id=run_id, resume="allow", config=config, dir=directory
            )
        except wandb.errors.Error as e:
            # Not logged in, no network: one line on every rank.
            message = f"--wandb cannot start its run ({first_line(e)})"
            raise UsageError(f"{message}: wandb login, or set WANDB_MODE=offline") from None
        self.run.define_metric("*", step_metric="global_step")

    def log_step(self, values: dict, global_step: int) -> None:
        row = {"global_step": global_step}
        for key, value in values.items():
            if value is not None:
                row[key] = value
        self.run.log(row)

    def log_epoch(self, record: dict, global_step: int) -> None:
        self.log_step({f"epoch/{key}": value for key, value in record.items()}, global_step)

    def replay(self, records: list[dict], epochs: list[dict], steps_per_epoch: int) -> None:
        """Every record kept, again and in order, each epoch's line after its steps' records: a kill
        may have cost the run what it got in its last seconds (W&B's service writes them every
        few seconds, and dies with the rank). None is missing; some come twice, alike."""
        epochs = list(epochs)
        for record in records:
            while epochs and epochs[0]["epoch"] < record["epoch"]:
                epoch = epochs.pop(0)
                self.log_epoch(epoch, epoch["epoch"] * steps_per_epoch)
            values = {k: v for k, v in record.items() if k not in ("epoch", "step", "global_step")}
            self.log_step(values, record["global_step"])
        for epoch in epochs:
            self.log_epoch(epoch, epoch["epoch"] * steps_per_epoch)


class StepRecords:
    """steps.jsonl by rank 0, and its sinks (TensorBoard, W&B): all ranks' numbers every few
    steps; a continued run's records go on as if it had never stopped."""

    def __init__(self, output_dir: Path, args, rank: int, steps_per_epoch: int):
        self.path = output_dir / "steps.jsonl"
        self.args = args
        self.rank = rank
        self.steps_per_epoch = steps_per_epoch
        # What a checkpoint holds (its shape: a sharded checkpoint loads into it); a W&B run id
        # alike on every rank.
        self.saved = {
            "sums": zero_sums(),
            "recorded": zero_sums(),
            "wandb_id": all_gather_objects(uuid.uuid4().hex[:12])[0],
        }
        self.meter = None
        self.sinks = []

    def meter_for_epoch(self, device: torch.device, first_step: int) -> Meter:
        saved = None
        if first_step:
            saved = self.saved
        self.meter = Meter(device, saved, self.rank)
        return self.meter

    def state_dict(self) -> dict:
        """The epoch's sums for a checkpoint, over all ranks: a collective."""
        state = dict(self.saved)
        if self.meter is not None:
            state["sums"] = self.meter.all_ranks_sums()
            state["recorded"] = self.meter.recorded
        return state

    def load_state_dict(self, state: dict) -> None:
        self.saved = state

    def start(self, epoch: int, step: int) -> None:
        """On rank 0: keep the records up to the checkpoint's epochs and steps done, and start the
        sinks; W&B gets every kept record again."""
        last = {"epoch": epoch, "global_step": epoch * self.steps_per_epoch + step}
        kept = {}
        for path, key in (
            (self.path.with_name("metrics.jsonl"), "epoch"),
            (self.path, "global_step"),
        ):
            lines = []
            if path.exists():
                lines = [line for line in path.read_text().splitlines() if line]
            records = [json.loads(line) for line in lines]
            kept[key] = [record for record in records if record[key] <= last[key]]
            kept_lines = [line for line, record in zip(lines, records) if record[key] <= last[key]]
            if kept_lines != lines:
                # Written anew whole: a full disk loses none.
                text = "".join(line + "\n" for line in kept_lines)
                write_atomically(path, text.encode())
        if self.args.tensorboard:
            first_step = last["global_step"] + 1
            self.sinks.append(TensorBoardSink(self.path.with_name("tensorboard"), first_step))
        if self.args.wandb:
            config = vars(self.args)
            wandb = WandbSink(self.args.wandb, self.saved["wandb_id"], config, self.path.parent)
            wandb.replay(kept["global_step"], kept["epoch"], self.steps_per_epoch)
            self.sinks.append(wandb)

    def train(self, epoch: int, step: int, lr: float, grad_norm: torch.Tensor, **more) -> None:
        """A training record (a collective: every rank calls it at the same step); a diverged run
        stops here."""
        record = dict(
            **self.meter.since_record(),
            lr=lr,
            grad_norm=float(grad_norm),
            peak_mem_mb=peak_memory_mb(self.meter.sums.device),
            **more,
        )
        check_finite(None, epoch, step, record, self.args)
        left = self.args.batch_size / record["images_per_s"] * (self.steps_per_epoch - step)
        self.add(epoch, step, record, f" left {datetime.timedelta(seconds=int(left))}")

    def add(self, epoch: int, step: int, values: dict, suffix: str = "") -> None:
        """A record of values at this step, and its console line; a collective: a failed write
        ends all ranks."""
        where = f"epoch {epoch + 1}/{self.args.epochs} step {step}/{self.steps_per_epoch}"
        log.info(f"{where} {format_record(values)}{suffix}")
        global_step = epoch * self.steps_per_epoch + step
        # A full disk ends every rank with one line.
        with errors_shared_by_all_ranks():
            # One writer: the numbers are all ranks' already (the others log warnings only).
            if self.rank == 0:
                record = dict(epoch=epoch + 1, step=step, global_step=global_step, **values)
                append_metrics(self.path, record)
                for sink in self.sinks:
                    sink.log_step(values, global_step)

    def epoch(self, record: dict) -> None:
        """On rank 0: the epoch's line in metrics.jsonl (whole or not at all), in the sinks at its
        last step, then printed."""
        append_metrics(self.path.with_name("metrics.jsonl"), record)
        for sink in self.sinks:
            sink.log_epoch(record, record["epoch"] * self.steps_per_epoch)
        shown = format_record(
            record, "train_loss", "train_acc", "val_loss", "val_acc", "val_acc_ema"
        )
        seconds = record["epoch_time_s"]
        speed = record["images_per_s"]
        where = f"epoch {record['epoch']}/{self.args.epochs}"
        log.info(f"{where} {shown} time {seconds:.1f}s {speed:.0f} img/s")


def format_record(record: dict, *keys: str) -> str:
    """'key value ...' of keys (all by default): losses and accuracies to 4 decimals, the rest to 4
    digits."""
    parts = []
    for key in keys or record:
        value = record.get(key)
        if value is None:
            continue
        if re.search("(loss|acc)(_ema)?$", key):
            parts.append(f"{key} {value:.4f}")
        else:
            parts.append(f"{key} {value:.4g}")
    return " ".join(parts)


def peak_memory_mb(device: torch.device) -> float:
    """This rank's peak memory: on a GPU allocated, on the CPU resident (getrusage's KiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def megabytes(tensors) -> float:
    """What this rank holds of tensors (its shards of FSDP's), in MB."""
    total = 0
    for tensor in tensors:
        shard = local_shard(tensor)
        total += shard.numel() * shard.element_size()
    return total / 2**20


def memory_mb(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> dict:
    """MB: peak memory; parameters, gradients, optimizer state held by this rank."""
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return dict(
        peak_mem_mb=peak_memory_mb(device),
        params_mb=megabytes(params),
        grads_mb=megabytes(p for p in params if p.requires_grad),
        optimizer_mb=megabytes(state),
    )


# ---------------------------------- checks: one line for what would fail ----


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


def check_first_step(
    model: nn.Module,
    loader: DataLoader,
    compute_loss: Callable,
    args,
    device: torch.device,
    unused_ok: bool,
) -> float:
    """A step of two samples, undone (in float32 whatever the training's precision: two samples
    are small): what would fail or learn nothing ends every rank with one line. Returns the FLOPs
    of a sample, counted around the model and loss only (FlopCounterMode would see our own
    collectives too)."""
    # Batch-norm statistics, put back afterwards.
    buffers = [b.clone() for b in model.buffers()]
    devices = []
    if torch.cuda.is_available():
        devices = [torch.cuda.current_device()]
    with torch.random.fork_rng(devices):
        # One rank's error ends every rank with its line; before backward(), a collective under
        # FSDP.
        with errors_shared_by_all_ranks():
            check_workers_can_take(loader)
            # Two samples for the step, more for the labels' check below (a stream's: its first
            # reader's).
            first = first_samples(loader, 256)
            samples, batch, more = collate_first(loader, first)
            inputs, targets = batch_to_device(batch, device, loader.dataset, args.channels_last)
            try:
                with FlopCounterMode(display=False) as forward_flops:
                    outputs = forward(model.train(), inputs)
            except (RuntimeError, ValueError, AssertionError, TypeError, IndexError) as e:
                if not raised_in(e, *LIBRARIES):
                    raise
                what = f"{first_line(e)}{called_from(e)}"
                raise UsageError(
                    f"the model cannot take the first batch's inputs: {what}"
                ) from None
            # On a GPU a bad label is a device-side assert that kills the process: more labels than
            # two samples have are checked.
            if is_default_loss(compute_loss):
                check_class_targets(outputs, batch_to_device(more, device, loader.dataset)[1])
            loss = compute_loss(outputs, targets)
            check_loss(loss)
        with FlopCounterMode(display=False) as backward_flops:
            if isinstance(loss, torch.Tensor):
                loss.backward()
            else:
                loss[0].backward()
    unused = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    model.zero_grad(set_to_none=True)
    for buffer, saved in zip(model.buffers(), buffers):
        buffer.copy_(saved)
    # Alike on every rank: the same model and code.
    if unused and not unused_ok:
        names = ", ".join(unused[:3])
        if len(unused) > 3:
            names += ", ..."
        raise UsageError(
            f"{len(unused)} parameters get no gradient ({names}): --find-unused-parameters lets DDP"
            " train such a model, or leave them out of it"
        )
    flops = forward_flops.get_total_flops() + backward_flops.get_total_flops()
    return flops / samples


def collate_first(loader: DataLoader, first: list) -> tuple[int, object, object]:
    """(samples, batch) of the first two samples, and the batch of all of them. What a library
    refused (default_collate: samples of two sizes) is one line; the user's own error is theirs."""
    try:
        samples, batch = loader.collate_fn(first[:2])
        more = loader.collate_fn(first)[1]
    except (RuntimeError, ValueError, TypeError, IndexError, KeyError) as e:
        if not raised_in(e, *LIBRARIES):
            raise
        what = f"{first_line(e)}{called_from(e)}"
        raise UsageError(f"collate cannot batch the first samples ({what}): pad them") from None
    return samples, batch, more


class DiscardedBytes:
    """A file that keeps nothing: a worker's pickle is checked, not kept."""

    write = staticmethod(len)


class PicklerWithoutTensors(pickle.Pickler):
    """Tensors go to the workers through shared memory, unpickled."""

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            return id(obj)
        return None


def check_workers_can_take(loader: DataLoader) -> None:
    """DataLoader workers start from a forkserver: the Dataset and collate must pickle (no lambda,
    no open file)."""
    if not loader.num_workers:
        return
    try:
        PicklerWithoutTensors(DiscardedBytes()).dump((loader.dataset, loader.collate_fn))
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise UsageError(
            f"the Dataset or collate cannot go to a DataLoader worker ({first_line(e)}): define"
            " their functions at module level, not as a lambda or inside a function, or use"
            " --workers 0"
        ) from None


def describe_value(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)}"
    return type(value).__name__


def check_loss(loss) -> None:
    """compute_loss gives a scalar (the batch's mean) or a pair (a scalar sum, its count)."""
    pair = isinstance(loss, (tuple, list)) and len(loss) == 2
    total, count = loss if pair else (loss, 1)
    scalar = isinstance(total, torch.Tensor) and total.dim() == 0
    one_count = isinstance(count, int) or (isinstance(count, torch.Tensor) and count.numel() == 1)
    if scalar and one_count:
        return
    what = describe_value(loss)
    if pair:
        what = f"({describe_value(total)}, {describe_value(count)})"
    raise UsageError(
        f"compute_loss must return a scalar tensor or a (sum, count) pair, not {what}: reduce"
        " it, e.g. with .mean()"
    )


def check_class_targets(outputs, targets) -> None:
    """The first batch's targets that the default loss, cross-entropy over outputs' dim 1, cannot
    mean."""
    classes = 0
    if isinstance(outputs, torch.Tensor) and outputs.dim() > 1:
        classes = outputs.shape[1]
    if classes == 1:
        raise UsageError(
            "the model gives 1 output per sample, and cross-entropy over one class is always 0: "
            "check num_classes, or replace compute_loss (a regression: F.mse_loss)"
        )
    class_indices = isinstance(targets, torch.Tensor) and not targets.is_floating_point()
    if classes and class_indices:
        low, high = int(targets.min()), int(targets.max())
        if low < 0 or high >= classes:
            raise UsageError(
                f"class labels from {low} to {high} in the first batch, outside [0, {classes}) for "
                f"the model's {classes} outputs: check num_classes, or replace compute_loss"
            )


def is_default_loss(compute_loss: Callable) -> bool:
    """Is compute_loss the default F.cross_entropy(outputs, targets), with no other name or
    constant (ignore_index=)? Read from its code object (tests/test_internals.py checks that each
    script's default is recognised)."""
    code = getattr(compute_loss, "__code__", None)
    if code is None:
        return False
    names = code.co_names == ("F", "cross_entropy")
    return names and set(code.co_consts) <= {None, compute_loss.__doc__}


# ----------------------------------- optimizer, schedule, weight average ----


def build_optimizer(params, args) -> torch.optim.Optimizer:
    """--optimizer with its peak lr and weight decay (check_args fills their defaults)."""
    # AdamW fused: each tensor in one pass, where foreach (the default) makes a temporary copy of
    # all the weights; not with float16 (FSDP's gradient scaler checks overflow on all ranks on the
    # foreach path only), nor for SGD (FSDP's shards have no fused SGD).
    if args.optimizer == "adamw":
        fused = None
        if getattr(args, "amp_dtype", None) != "float16":
            fused = True
        return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, fused=fused)
    return torch.optim.SGD(
        params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay
    )


class WarmupCosine:
    """The lr factor at a step: a linear rise over the first `warmup` part of `steps`, then a
    cosine decay to 0."""

    def __init__(self, steps: int, warmup: float):
        self.steps = steps
        self.rise = max(1, round(warmup * steps))

    def __call__(self, step: int) -> float:
        if step < self.rise:
            return (step + 1) / self.rise
        decayed = (step - self.rise) / max(1, self.steps - self.rise)
        return 0.5 * (1 + math.cos(math.pi * decayed))


def warmup_cosine(
    optimizer: torch.optim.Optimizer, steps: int, warmup: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning-rate schedule, stepped per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(steps, warmup))


class EMA:
    """--ema DECAY: a moving average of the weights and buffers, updated after each optimizer step
    on every rank (under FSDP each its own shards), validated and saved beside them. Its decay is
    min(DECAY, (1 + n) / (10 + n)) at update n (TensorFlow's num_updates): the first weights fade
    fast. Without --ema it does nothing.
    """

    def __init__(self, model: nn.Module, decay: float | None):
        self.model = unwrap(model)
        self.decay = decay
        self.updates = 0
        self.average = {}
        if decay is not None:
            self.average = {name: t.detach().clone() for name, t in self.named().items()}

    def named(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers by plain name (no DDP "module."), each once (a tied head is
        one)."""
        return dict([*self.model.named_parameters(), *self.model.named_buffers()])

    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(average, weight): this rank's part of each."""
        named = self.named()
        return [
            (local_shard(average), local_shard(named[name]).detach())
            for name, average in self.average.items()
        ]

    @torch.no_grad()
    def update(self) -> None:
        self.updates += 1
        weight = 1 - min(self.decay or 0, (1 + self.updates) / (10 + self.updates))
        for average, live in self.pairs():
            # Integers (batch norm's count) are copied as they are.
            if average.is_floating_point():
                average.lerp_(live, weight)
            else:
                average.copy_(live)

    @contextlib.contextmanager
    def swapped(self):
        """The model holds the average within, then its own weights again, bit for bit."""
        self.swap()
        yield  # an error in it ends the run: no step is ever taken on the average
        self.swap()

    @torch.no_grad()
    def swap(self) -> None:
        # A tensor at a time: no second copy of the model.
        for average, live in self.pairs():
            kept = live.clone()
            live.copy_(average)
            average.copy_(kept)

    def evaluated(self, evaluate: Callable[[], dict]) -> dict:
        """evaluate()'s record; with --ema the average's too."""
        record = evaluate()
        if self.average:
            with self.swapped():
                for key, value in evaluate().items():
                    if key != "val_images":
                        record[f"{key}_ema"] = value
        return record

    def state_dict(self) -> dict:
        return {"updates": self.updates, "average": self.average}

    def load_state_dict(self, state: dict) -> None:
        if state["average"].keys() != self.average.keys():
            raise ValueError("its --ema is not this run's")
        # A sharded checkpoint has loaded into the average itself; checkpoint.pt's tensors go to
        # its device.
        self.updates = state["updates"]
        for name, tensor in state["average"].items():
            self.average[name] = tensor.to(self.average[name].device)


# ---------------------------------------- stops, checkpoints and metrics ----


class StopSignal:
    """Notes SIGTERM and SIGUSR1 (preemption, Slurm's --signal) instead of dying at once; all ranks
    agree on the step to stop after."""

    def __init__(self):
        self.signal = 0
        self.work = None
        self.flags = torch.zeros(2, dtype=torch.long)
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(signum, self.note)
        # With GPUs the flags go over the CPU: no GPU synchronisation every step.
        self.group = None
        if dist.is_initialized() and dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo")

    def note(self, signum: int, frame) -> None:
        self.signal = signum

    def agreed(self) -> tuple[int, bool]:
        """(the signal of any rank or 0, does some rank lack the next batch), as they were when
        this step began."""
        # Once a step, after its backward: the all-reduce is done by then.
        if self.work is not None:
            self.work.wait()
            self.work = None
        return int(self.flags[0]), bool(self.flags[1])

    def steps(self, batches, first_step: int, steps: int):
        """(step, batch) up to steps while every rank has a batch, read one ahead: the same steps
        on every rank. A batch one rank cannot read (a bad file) ends every rank with its line."""
        batches = iter(batches)
        step = first_step
        batch = None
        ahead = None
        error = ""
        if step < steps:
            ahead, error = next_batch(batches)
        while True:
            # Each step starts the all-reduce that agreed() waits for: 1 where a rank has no next
            # batch, 2 where one could not read it.
            lacking = 2 if error else int(ahead is None)
            self.flags = torch.tensor([self.signal, lacking])
            if dist.is_initialized():
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
        if self.flags[1] == 2:
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


@contextlib.contextmanager
def errors_shared_by_all_ranks():
    """A block that reads or writes files: its OSError (a full disk) or UsageError ends every rank
    with one line."""
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


def check_output_dir(path: Path) -> None:
    """Create the output directory and prove that it takes a file, before any data or model is
    built."""
    path.mkdir(parents=True, exist_ok=True)
    tempfile.TemporaryFile(dir=path).close()


def save_checkpoint(state: dict, path: Path) -> None:
    """state at path, atomically, written straight into the file: no copy in memory."""
    write_atomically(path, functools.partial(torch.save, state))


def write_atomically(path: Path, data: bytes | Callable) -> None:
    """data, or what data(file) writes, at path: a crash or a full disk mid-write leaves the
    previous file and no temporary file; a failed write is an OSError that names path."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with progress.writing(path, tmp), open(tmp, "wb") as f:
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


def load_checkpoint_everywhere(path: Path, rank: int) -> dict | None:
    """The checkpoint at path or None; rank 0 reads it and sends it to all (no shared file system
    needed), a tensor at a time, so that no rank holds a second copy (sent as one pickled object,
    the receivers held it 4 times)."""
    state = None
    with errors_shared_by_all_ranks():
        if rank == 0 and path.exists():
            state = read_checkpoint(path)
    if world_size() == 1:
        return state
    # Each tensor goes first as its shape and dtype, then alone.
    leaves, spec = tree_flatten(state)
    box = [[to_meta(leaf) for leaf in leaves], spec]
    dist.broadcast_object_list(box, src=0)
    # The tensors stay on the CPU.
    group = None
    if dist.get_backend() != "gloo":
        group = dist.new_group(backend="gloo")
    for i, leaf in enumerate(box[0]):
        if not torch.is_tensor(leaf):
            continue
        if rank == 0:
            box[0][i] = leaves[i].contiguous()
        else:
            box[0][i] = torch.empty(leaf.shape, dtype=leaf.dtype)
        dist.broadcast(box[0][i], src=0, group=group)
    return tree_unflatten(*box)


def to_meta(leaf):
    if torch.is_tensor(leaf):
        return leaf.to("meta")
    return leaf


def read_checkpoint(path: Path) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # unpickling errors have many types
        message = f"{path} is not a readable checkpoint ({first_line(e)})"
        raise UsageError(f"{message}: delete it or use another --output-dir") from None
    if not (isinstance(state, dict) and {"model", "optimizer", "epoch"} <= state.keys()):
        message = f"{path} is not a checkpoint of these scripts"
        raise UsageError(f"{message}: delete it or use another --output-dir")
    return state


def rng_states() -> dict:
    """The global random streams (dropout's; alike on all ranks): a continued run draws what a
    straight one would."""
    states = {"rng": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda_rng"] = torch.cuda.get_rng_state()
    return states


def restore(state: dict, path: Path | str, args, **stateful) -> tuple[int, int]:
    """Load stateful (model, optimizer, scheduler, scaler) and the random streams, and say so;
    returns the epochs done and the steps done in the next."""
    written_with = (
        ("--arch", state.get("arch"), args.arch),
        ("--optimizer", state.get("optimizer_name"), args.optimizer),
    )
    # One line, not a failed load or step.
    for flag, saved, value in written_with:
        if saved not in (None, value):
            message = f"{path} was written with {flag} {saved}, not {flag} {value}"
            raise UsageError(f"{message}: use another --output-dir")
    try:
        for name, obj in stateful.items():
            obj.load_state_dict(state[name])
        torch.set_rng_state(state.get("rng", torch.get_rng_state()))
        if "cuda_rng" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda_rng"])
    except (RuntimeError, KeyError, ValueError) as e:
        message = f"{path} does not fit this model or these flags ({first_line(e)})"
        raise UsageError(f"{message}: use another --output-dir") from None
    epoch = state["epoch"]
    step = state.get("step", 0)
    done = f"{epoch} of {args.epochs} epochs done"
    if step:
        done += f" and {step} steps of the next"
    log.info(f"continuing from {path}: {done}")
    return epoch, step


def save_pretrained(model: nn.Module, directory: Path, state: dict | None = None) -> None:
    """A Hugging Face model as its save_pretrained writes it (a PEFT model: the adapter alone), for
    from_pretrained: from state, its whole weights with plain keys, where the model holds shards;
    in place once complete. Any other model: model.pt or checkpoint.pt is all."""
    if not hasattr(model, "save_pretrained"):
        return
    if state is None:
        state = model.state_dict()
    new = directory.with_name(directory.name + ".new")
    with progress.writing(directory, new):
        model.save_pretrained(new, state_dict=state)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(new, directory)


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
