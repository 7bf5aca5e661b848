"""The ranks of a run: joining the process group (from_environment, init_method,
rendezvous_store, fresh_namespace, init_errors_as_one_line), which rank prints (setup_logging),
collectives that also work in a world of one (all_reduce, all_gather_objects, gather_on_rank_0),
the host memory a node's ranks share (host_memory_available), and errors_shared_by_all_ranks, a
block that every rank enters and that ends every rank with one rank's error.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import functools
import inspect
import logging
import os
import re
import socket
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

import torch
import torch.distributed as dist
import torch.nn as nn

from .errors import UsageError, first_line
from .internals import tree_map_only

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


# Where the memory cgroups are mounted (version 2 here, version 1 under memory/).
CGROUP = Path("/sys/fs/cgroup")


def host_memory_available() -> float:
    """The bytes this node's processes share: the host's MemAvailable, or less where a memory cgroup
    (a container's, a Slurm job's) limits them; infinite where neither can be read."""
    available = float("inf")
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        available = int(meminfo.read_text().split("MemAvailable:")[1].split()[0]) * 1024
    return min(available, cgroup_memory_left())


def cgroup_memory_left() -> float:
    """What the memory cgroups of this process leave it, the tightest: each limit less its usage,
    the page cache it may drop (inactive files) not counted as used; version 2 or 1, at the
    mount's root (a container's own cgroup), at the process's path and above it (a Slurm job's
    step and job); infinite without a limit."""
    paths = {PurePosixPath("/")}
    if Path("/proc/self/cgroup").exists():
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers in ("", "memory"):
                paths.update([PurePosixPath(path), *PurePosixPath(path).parents])
    left = float("inf")
    for path in paths:
        relative = str(path).lstrip("/")
        for folder, limit, usage, inactive in (
            (CGROUP / relative, "memory.max", "memory.current", "inactive_file"),
            (
                CGROUP / "memory" / relative,
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                "total_inactive_file",
            ),
        ):
            if not ((folder / limit).is_file() and (folder / usage).is_file()):
                continue
            bound = (folder / limit).read_text().strip()
            # no limit: "max", or version 1's largest page-aligned number
            if bound == "max" or int(bound) >= 2**62:
                continue
            stat = (
                (folder / "memory.stat").read_text() if (folder / "memory.stat").is_file() else ""
            )
            dropped = dict(line.split() for line in stat.splitlines()).get(inactive, 0)
            left = min(left, int(bound) - int((folder / usage).read_text()) + int(dropped))
    return left


def all_gather_objects(obj, group=None) -> list:
    """Every rank calls it: every rank's obj, in rank order; [obj] in a world of one."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    objects = [None] * dist.get_world_size(group)
    dist.all_gather_object(objects, obj, group=group)
    return objects


def gather_on_rank_0(obj) -> list | None:
    """Every rank calls it: every rank's obj, its tensors copied to the CPU, on rank 0 alone."""
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


class TrainedTogether(nn.ModuleDict):
    """Models trained together, by name (a GAN's generator and discriminator), as build_model
    returns them: each in its own DDP, with its own optimizer and schedule, run.model["generator"];
    its forward (a subclass's) is what validation and the start-up check call."""


class Wrapped(nn.ModuleDict):
    """Models trained together (TrainedTogether), each in its own wrapper, wrap(part, **options)
    (its own DDP): run.model["generator"]. Its module, which unwrap() gives, is the ModuleDict as
    built: what validation calls, what the checkpoints save."""

    def __init__(self, models: nn.ModuleDict, wrap: Callable[..., nn.Module], **options):
        super().__init__({name: wrap(part, **options) for name, part in models.items()})
        self.__dict__["module"] = models  # not a submodule: its weights are the parts' own

    def register_comm_hook(self, state, hook: Callable) -> None:
        for part in self.values():
            part.register_comm_hook(state, hook)

    def train(self, mode: bool = True) -> Wrapped:
        self.module.train(mode)  # the ModuleDict as built too, whose forward validation calls
        return super().train(mode)


def each(model: nn.Module, wrap: Callable[..., nn.Module], **options) -> nn.Module:
    """wrap(model, **options); models trained together (Wrapped): each part so, in its place."""
    if not isinstance(model, Wrapped):
        return wrap(model, **options)
    for name, part in list(model.items()):
        model[name] = wrap(part, **options)
    return model


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
