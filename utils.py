"""The core every script imports: what makes any run right, in one file of torch and the standard
library. In the order a reader of distributed.py meets it:

- errors: UsageError, and run_main, which ends every error of ours or a library's in one line;
- the ranks: joining the process group on loopback unless told otherwise (init_method,
  rendezvous_store), which rank prints (log), each rank's part of a global batch (share,
  split_batch), collectives that also work in a world of one, and errors_shared_by_all_ranks, a
  block that every rank enters and that ends every rank with one rank's error;
- the stop every rank agrees on (StopSignal: SIGTERM, SIGUSR1, --save-minutes);
- the flags every script shares (build_parser, check_args), DDP's own (add_ddp_flags).

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
import json
import logging
import os
import re
import signal
import socket
import sys
import sysconfig
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.distributed as dist
import torch.nn as nn

# PyTorch 2.8 or newer: on an older one a gloo process group could hang at exit (PyTorch PR
# 154976), and a listening socket failed the tcp:// store. 2.8.0a0 (a container's build) is 2.8.
if tuple(map(int, torch.__version__.split(".")[:2])) < (2, 8):
    raise SystemExit(
        f"error: the scripts need PyTorch 2.8 or newer, not {torch.__version__}: pip install -r"
        " requirements.txt"
    )


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
    failing at once could run together."""
    sys.stderr.write(f"{line}\n")


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
            # A bug, the user's or ours: its traceback in one write (print_exc writes it a line
            # at a time, and the ranks that raise at once would interleave theirs).
            sys.stderr.write(traceback.format_exc())
            exit_code = 1
    finally:
        # A line to say: torchrun's SIGTERM, sent once another rank has ended with the same error,
        # waits for it (the teardown below can take a loaded machine a second).
        if line is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # After the except blocks, whose exception kept main's frames (the model, DDP, FSDP)
        # alive. W&B's records on disk before the line.
        wandb = sys.modules.get("wandb")
        if wandb is not None and wandb.run is not None:
            wandb.finish(exit_code=int(exit_code != 0 or line is not None))
        # Free them and their process groups while the interpreter is whole.
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
    worker killed, a failed collective. None for any other (a bug, the user's or ours), which
    keeps its traceback."""
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


# ---- the ranks: the process group, each rank's part, collectives ----

log = logging.getLogger("train")


def setup_logging(rank: int) -> None:
    """Rank 0 prints progress; the other ranks print warnings and errors only."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        stream=sys.stdout,
        force=True,
        format="%(message)s" if rank == 0 else f"[rank {rank}] %(message)s",
    )


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
            return fresh_namespace(agent_store, rank, world_size, timeout)
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


def from_environment(args) -> tuple[int, int, int]:
    """(rank, local rank, world size) as torchrun, torch.distributed.launch (--local-rank) or
    Slurm's srun sets them; (0, 0, 1) without them: a world of one. A local rank without a GPU of
    its own is refused in one line."""
    # srun without torchrun: RANK, WORLD_SIZE and LOCAL_RANK from Slurm's variables
    ranks_from_slurm(args.port)
    env = os.environ
    rank, world_size = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    local_rank = int(env.get("LOCAL_RANK", args.local_rank))
    if torch.cuda.is_available() and local_rank >= torch.cuda.device_count():
        raise UsageError(
            f"local rank {local_rank}, but this node has {torch.cuda.device_count()} GPUs: start"
            " one process per GPU"
        )
    return rank, local_rank, world_size


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


def set_cpu_threads(local_world_size: int) -> None:
    """Processes that share a machine's cores must not each use all of them."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))


def ranks_from_slurm(port: int | None) -> None:
    """Under srun without torchrun: RANK, WORLD_SIZE and LOCAL_RANK from Slurm's variables, and
    MASTER_ADDR (the node list's first host) and MASTER_PORT (port, or 29500) unless set."""
    env = os.environ
    if "RANK" in env or "SLURM_PROCID" not in env:
        return
    env.update(
        RANK=env["SLURM_PROCID"], WORLD_SIZE=env["SLURM_NTASKS"], LOCAL_RANK=env["SLURM_LOCALID"]
    )
    nodelist = env.get("SLURM_JOB_NODELIST") or env["SLURM_NODELIST"]
    env.setdefault("MASTER_ADDR", slurm_master_addr(nodelist))
    env.setdefault("MASTER_PORT", str(port or 29500))


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
    """Every rank calls it: tensor, in place, summed (or op) over all ranks; as it is in a world
    of one."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def world_size() -> int:
    """The processes of the run: 1 without a process group."""
    if dist.is_initialized():
        return dist.get_world_size()
    return 1


@functools.cache
def cpu_group() -> dist.ProcessGroup | None:
    """The group that CPU tensors cross in: all ranks over gloo, made at the first call (every
    rank's, at the same place) where the run's own group is NCCL's; None (the run's own) on gloo."""
    return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def rank() -> int:
    """This process's place in the run: 0 without a process group."""
    if dist.is_initialized():
        return dist.get_rank()
    return 0


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


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside DDP, DataParallel and torch.compile wrappers (models trained
    together: the ModuleDict as built)."""
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
        "--profile",
        default=None,
        metavar="A:B",
        help="torch.profiler over optimizer steps A to B of the run (default: off), the step's"
        " phases marked: a"
        " Chrome trace a rank in OUTPUT_DIR/profile/",
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
    if any(value is not None and not value >= 0 for value in (args.lr, args.momentum)):
        raise UsageError("--lr and --momentum must be >= 0")
    if args.weight_decay is not None and not args.weight_decay >= 0:
        raise UsageError("--weight-decay must be >= 0")
    if args.port is not None and not 0 < args.port < 65536:
        raise UsageError(f"--port {args.port} is not a port: give 1 to 65535")
    if not 0 <= args.warmup < 1:
        raise UsageError("--warmup must be in [0, 1)")
    if args.ema is not None and not 0 <= args.ema < 1:
        message = "the average spans about 1 / (1 - DECAY) steps"
        raise UsageError(f"--ema {args.ema:g} is not in [0, 1): {message}")
    if args.backend == "nccl" and not torch.cuda.is_available():
        raise UsageError("--backend nccl needs GPUs, and none is visible: leave it out for gloo")
    if args.compile_mode is not None:
        args.compile = True
    if args.keep_best_mode is not None and args.keep_best is None:
        raise UsageError("--keep-best-mode needs --keep-best NAME, the validation figure it ranks")
    # --keep-best: lower is better for a loss (timm's rule), higher for the rest
    if args.keep_best_mode is None and args.keep_best is not None:
        args.keep_best_mode = "max"
        if "loss" in args.keep_best:
            args.keep_best_mode = "min"
    steps_to_profile(args.profile)  # a --profile that names no steps ends here
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
    return args


def steps_to_profile(spec: str | None) -> tuple[int, int] | None:
    """--profile A:B as (A, B), optimizer steps of this run counted from 1; None without it."""
    if not spec:
        return None
    first, _, last = spec.partition(":")
    if not (first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
        raise UsageError(f"--profile {spec}: give the first and last step as A:B, 1 <= A <= B")
    return int(first), int(last)
