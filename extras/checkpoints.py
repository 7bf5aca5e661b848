"""Files written whole: checkpoints (atomically, a tensor at a time, loaded with weights_only=True),
written by a thread while training goes on (Saves), read by rank 0 and sent to every rank
(load_checkpoint_everywhere), restored (restore); a tied parameter saved once (without_ties,
tied_once); metrics.jsonl's lines; a Hugging Face model's save_pretrained.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path, PurePosixPath

import torch
import torch.distributed as dist
import torch.nn as nn

from utils import (
    UsageError,
    cpu_group,
    errors_shared_by_all_ranks,
    first_line,
    local_ranks,
    local_shard,
    tree_flatten,
    tree_unflatten,
    world_size,
    write_atomically,
)

log = logging.getLogger("train")


def save_checkpoint(state: dict, path: Path, watchdog=None) -> None:
    """state at path, atomically, written straight into the file: no copy in memory; the
    watchdog (stalls.Watchdog) times its bytes."""
    write_atomically(path, functools.partial(torch.save, state), watchdog)


class Saves:
    """Checkpoints written by a thread of their own while training goes on (rank 0's files; under
    FSDP every rank's shards): a save copies the state to host memory and returns; the thread
    writes the copy atomically, as save_checkpoint does (the watchdog times its bytes). A save of
    a file whose last save is still being written waits for it: one save of each file in flight.
    Where host memory has no room for a copy, the save is written before it returns, as before.
    A write that failed is said by wait(), and failed() tells the step's agreement
    (stops.StopSignal), so that every rank ends with its line at the next step; the last whole
    file stays. Leaving the block waits for what is being written (an error ends the run: the
    newest checkpoint is kept whole)."""

    def __init__(self, stop=None):
        """stop: the run's StopSignal, told of each write that failed (every rank ends with its line
        at the next step)."""
        if stop is not None:
            stop.watch(self)
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        self.writes: dict[Path, Future] = {}
        # each file's host copies, kept for its next save: a copy into memory already mapped runs
        # at memory's speed, a new one pays for its page faults too
        self.copies: dict[Path, list[torch.Tensor]] = {}
        self.in_place: set[Path] = set()  # the files host memory has no room to copy

    def save(
        self, state: dict, path: Path, watchdog=None, write: Callable = save_checkpoint
    ) -> None:
        """A copy of state, taken now, for path; written in the background by write(copy, path,
        watchdog): torch.save's one file, or every rank's shards (an FSDP script's sharded save)."""
        last = self.writes.pop(path, None)
        if last is not None:
            last.result()  # its error, if it failed
        # where host memory lacks room for a copy: written before training goes on, as it was,
        # after the writes in flight (one write at a time, which the watchdog times)
        if not self.room_for_copy(state, path):
            self.wait()
            write(state, path, watchdog)
            return
        copy = self.host_copy(state, path)
        if watchdog is not None:
            watchdog.save_taken()
        self.writes[path] = self.writer.submit(write, copy, path, watchdog)

    def host_copy(self, state: dict, path: Path) -> dict:
        """state with each tensor copied into path's host copies (made anew where they differ); a
        tensor that appears twice (a tied head and embedding) is copied, and saved, once; a shard
        of an FSDP parameter (a DTensor), its rank's part."""
        leaves, spec = tree_flatten(state)
        unique = each_tensor_once(leaves)
        kept = self.copies.get(path, [])
        if [(k.shape, k.dtype) for k in kept] != [(t.shape, t.dtype) for t in unique.values()]:
            pin = any(t.is_cuda for t in unique.values())
            kept = [torch.empty_like(t, device="cpu", pin_memory=pin) for t in unique.values()]
            self.copies[path] = kept
        for copy, tensor in zip(kept, unique.values()):
            copy.copy_(tensor)
        places = {key: i for i, key in enumerate(unique)}
        leaves = [
            in_place_of(leaf, kept[places[tensor_key(leaf)]])
            if isinstance(leaf, torch.Tensor)
            else leaf
            for leaf in leaves
        ]
        return tree_unflatten(leaves, spec)

    def room_for_copy(self, state: dict, path: Path) -> bool:
        """Does path keep its host copies, or would a new one take at most half of the host memory
        available to each of this node's processes? A state that fills the host (a model sharded
        over CPU processes to fit at all) is written before training goes on, said once."""
        if path in self.copies:
            return True
        if path not in self.in_place:
            size = sum(
                t.numel() * t.element_size()
                for t in each_tensor_once(tree_flatten(state)[0]).values()
            )
            room = host_memory_available() / local_ranks() / 2
            if size <= room:
                return True
            log.info(
                f"{path.name}: written before training goes on, not in the background: a copy of"
                f" its {size / 1e9:.2f} GB would take more than half of the"
                f" {2 * room / 1e9:.1f} GB of host memory available to each process"
            )
            self.in_place.add(path)
        return False

    def failed(self) -> bool:
        """Has a write that ended failed?"""
        return any(w.done() and w.exception() is not None for w in self.writes.values())

    def wait(self) -> None:
        """Every file written; a failed write's OSError, which names its file."""
        writes, self.writes = self.writes, {}
        for write in writes.values():
            write.result()

    def __enter__(self) -> Saves:
        return self

    def __exit__(self, *exc) -> None:
        # Whatever ends the run: the files being written are written (or fail) before it ends.
        self.writer.shutdown(wait=True)


def write_error(directory: Path) -> OSError:
    """Why writing into directory fails, as the OS says it (a full disk): torch.save inside a
    sharded save can report a short write as a C++ error."""
    probe = directory / f".probe{os.getpid()}"
    try:
        probe.write_bytes(bytes(2**20))
    except OSError as e:
        return OSError(e.errno, e.strerror, str(directory))
    finally:
        probe.unlink(missing_ok=True)
    return OSError(errno.EIO, "a shard could not be written", str(directory))


def first_failure(error: BaseException) -> BaseException:
    """A sharded save's or load's error (dcp's CheckpointException, which holds each rank's): the
    first rank's; any other as it is."""
    failures = getattr(error, "failures", None)
    return next(iter(failures.values()))[0] if failures else error


def each_tensor_once(leaves: list) -> dict[tuple, torch.Tensor]:
    """The tensors among leaves, each once (a tensor that appears twice: a tied head and embedding),
    in the order they first appear; a shard of an FSDP parameter (a DTensor), its rank's part."""
    unique: dict[tuple, torch.Tensor] = {}
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            unique.setdefault(tensor_key(leaf), local_shard(leaf).detach())
    return unique


def tensor_key(tensor: torch.Tensor) -> tuple:
    """What makes two tensors one: the same memory, seen the same way (a DTensor: its shard's)."""
    tensor = local_shard(tensor)
    return (tensor.device, tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype)


def in_place_of(tensor: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
    """copy, a host copy of tensor's data, in its place: a DTensor's shard stays a DTensor with the
    same placement on the same mesh (what DCP's own staging builds), for DCP to write."""
    if hasattr(tensor, "to_local"):
        return dtensor_of(copy, tensor)
    return copy


def load_checkpoint_everywhere(path: Path, rank: int) -> dict | None:
    """Every rank calls it: the checkpoint at path or None; rank 0 reads it and sends it to all
    (no shared file system needed), a tensor at a time, so that no rank holds a second copy (sent
    as one pickled object, the receivers held it 4 times)."""
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
    for i, leaf in enumerate(box[0]):
        if not torch.is_tensor(leaf):
            continue
        if rank == 0:
            box[0][i] = leaves[i].contiguous()
        else:
            box[0][i] = torch.empty(leaf.shape, dtype=leaf.dtype)
        dist.broadcast(box[0][i], src=0, group=cpu_group())
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


def restore(state: dict | None, path: Path | str, args, **stateful) -> tuple[int, int]:
    """Load stateful (model, optimizer, scheduler, scaler, an ema or None), and say so; returns the
    epochs done and the steps done in the next, (0, 0) without a checkpoint (state None). The
    random streams need no state: each step's come from where it is (utils.seed_step)."""
    if state is None:
        return 0, 0
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
            # None: what this run keeps none of (no --ema), nor may the checkpoint hold a tensor of
            # it (an average without tensors: one written before the average was an extra)
            if obj is None and any(torch.is_tensor(x) for x in tree_flatten(state.get(name))[0]):
                raise ValueError(f"it holds {name}, which this run keeps none of")
            if obj is not None:
                obj.load_state_dict(state[name])
    except (RuntimeError, KeyError, ValueError) as e:
        message = f"{path} does not fit this model or these flags ({first_line(e)})"
        raise UsageError(f"{message}: use another --output-dir") from None
    epoch = state["epoch"]
    step = state.get("step", 0)
    done = f"{epoch} of {args.epochs} epochs done"
    if step:
        done += f" and {step} steps of the next"
    # an elastic run continues on another number of processes: which, and which wrote it
    where = "on 1 process"
    if world_size() > 1:
        where = f"on {world_size()} processes"
    if "world_size" in state:
        where += f", written on {state['world_size']}"
    # The data and its augmentation are the straight run's; dropout is drawn per rank.
    if state.get("world_size", world_size()) != world_size():
        done += (
            "; randomness inside the model (dropout) is drawn per rank from here"
            f" ({world_size()} of them, {state['world_size']} before)"
        )
    log.info(f"continuing from {path} {where}: {done}")
    return epoch, step


def tied_names(model: nn.Module) -> dict[str, str]:
    """Each later name of a parameter the model holds under several (GPT-2's head, tied to its token
    embeddings), to its first name."""
    first: dict[int, str] = {}
    later = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(parameter), name)
        if first[id(parameter)] != name:
            later[name] = first[id(parameter)]
    return later


def without_ties(weights: dict, model: nn.Module) -> dict:
    """weights with a tied parameter under its first name only: saved once, gathered once."""
    later = tied_names(model)
    return {name: value for name, value in weights.items() if name not in later}


def tied_once(weights: dict, model: nn.Module) -> dict:
    """weights (gathered or read without their ties: each key its own tensor, or one missing) with
    the keys of one tied parameter holding one tensor again: saved once in model.pt, seen as tied
    by save_pretrained, loaded by a strict load_state_dict."""
    for name, first in tied_names(model).items():
        if first in weights:
            weights[name] = weights[first]
    return weights


def save_pretrained(model: nn.Module, directory: Path, watchdog, state: dict | None = None) -> None:
    """A Hugging Face model as its save_pretrained writes it (a PEFT model: the adapter alone), for
    from_pretrained: from state, its whole weights with plain keys, where the model holds shards;
    in place once complete, the watchdog (stalls.Watchdog) timing its bytes. Any other model:
    model.pt or checkpoint.pt is all."""
    if not hasattr(model, "save_pretrained"):
        return
    if state is None:
        state = model.state_dict()
    new = directory.with_name(directory.name + ".new")
    with watchdog.writing(directory, new):
        model.save_pretrained(new, state_dict=state)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(new, directory)


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


def dtensor_of(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A DTensor of local (a host copy of like's shard) with like's placement on like's mesh: what
    DCP's own staging for async_save builds, for dcp.save to write. DTensor.from_local would move
    it to the mesh's device."""
    return type(like)(local, like._spec, requires_grad=False)
