"""What the training scripts share and no approach owns; each script holds its recipe, builtin.py the demo data.

Its sections, in this order:
- flags and errors: the flags every script shares (build_parser, check_args), UsageError, and run_main, which ends
  every error of ours or a library's in one line (raised_in tells them from the user's own, which keep their
  traceback);
- logging: rank 0 prints progress, the other ranks warnings;
- distributed: joining the group (rendezvous_store, fresh_namespace, describe_init_error), all_reduce, gathered,
  gathered_on_rank_0, unwrap, local;
- the watchdog: no silent hang: Watchdog, which ends every rank within --timeout of a stall, naming the stalled
  rank, its step and its line, with every rank's stacks in OUTPUT_DIR/stalls/; init_worker, a DataLoader worker's
  start (it leaves SIGTERM to its rank and writes its stack when asked);
- any batch, any task: Counted (samples per batch), forward, loss_for_backward, logits, class_indices;
- data: batch_to_device (each batch is progress for the watchdog), StreamSampler (a stream's global batches, every
  sample once whatever its shards' sizes), Samples, steps_per_epoch, epoch_loader, worker_start (DataLoader
  workers from a forkserver), first_samples;
- metering and records: Meter, StepRecords (steps.jsonl, TensorBoard, W&B), numbers, memory;
- checks: one line for what would fail: check_finite, check_first_step, check_loss, check_class_targets;
- optimizer, schedule, weight average: build_optimizer, warmup_cosine, EMA;
- stops, checkpoints and metrics: StopSignal, errors_shared_by_all_ranks, checkpoints written atomically and sent
  a tensor at a time, restore, save_pretrained, append_metrics.
"""
from __future__ import annotations

import argparse, contextlib, datetime, errno, functools, gc, hashlib, importlib, inspect, itertools
import json, logging, math, multiprocessing, multiprocessing.connection, multiprocessing.forkserver, os, pickle, re
import resource, shutil, signal, socket, sys, sysconfig, tempfile, time, traceback, uuid
from pathlib import Path
from collections.abc import Callable, Mapping
from urllib.parse import urlparse

# PyTorch's C++ side logs rendezvous retries with stack dumps; our errors say it in one
# line. Must be set before torch loads; TORCH_CPP_LOG_LEVEL=INFO shows everything again.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
# a rank that ends at once (an error, a stall) leaves its forkserver workers' named semaphores to the resource
# tracker, which frees them, and would warn about each run on stderr
if "ignore:resource_tracker" not in os.environ.get("PYTHONWARNINGS", ""):
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), "ignore:resource_tracker"]))
import torch  # noqa: E402
import torch.distributed as dist
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten  # nested tuples, lists, dicts
from torch.utils.data import DataLoader, Dataset, IterableDataset

# an older one: a gloo process group could hang at exit (PyTorch PR 154976), a listening socket failed the tcp:// store
if tuple(map(int, torch.__version__.split(".")[:2])) < (2, 8):  # 2.8.0a0 (a container's build) counts as 2.8
    sys.exit(f"error: the scripts need PyTorch 2.8 or newer, not {torch.__version__}: pip install -r requirements.txt")

log = logging.getLogger("train")


# ------------------------------------------------------ flags and errors ----

class UsageError(Exception):
    """A mistake the user can fix: printed as one line, exit status 1."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag ends in one line, and --flag_name is accepted for --flag-name."""

    def error(self, message: str) -> None:  # run_main prints it as every other error
        raise UsageError(f"{message} (see {self.prog} --help)")

    def parse_known_args(self, args=None, namespace=None):
        # the name only, up to an "=": values keep their underscores
        kebab = lambda arg: re.sub("^--[^=]+", lambda name: name[0].replace("_", "-"), arg)  # noqa: E731
        return super().parse_known_args(list(map(kebab, sys.argv[1:] if args is None else args)), namespace)


def build_parser(description: str) -> ArgumentParser:
    """The flags every script shares (../shared/CONTRACT.md); scripts add their own."""
    p = ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       epilog="Every flag may also be spelt with underscores: --batch_size 128.")
    add = p.add_argument
    add("--dataset", default="cifar100", choices=["cifar10", "cifar100", "imagefolder", "fake"], help="built-in data")
    add("--data-dir", default="./data", help="where data lives or is downloaded to")
    add("--no-download", action="store_true", help="fail instead of downloading missing CIFAR")
    add("--fake-size", type=int, default=50_000, help="training images of --dataset fake")
    add("--image-size", type=int, default=32, help="side of imagefolder and fake images")
    add("--no-augment", action="store_true", help="no random crops or flips (exact reproducibility checks)")
    add("--arch", default="resnet18", help="tiny, or a torchvision classifier name")
    add("--epochs", type=int, default=30, help="planned epochs (the lr schedule spans them)")
    add("--steps-per-epoch", type=int, default=None, metavar="N", help="cut epochs at N steps (a stream without len)")
    add("--stop-after", type=int, default=None, metavar="N", help="end after N epochs; the same command continues")
    add("--batch-size", type=int, default=256, help="GLOBAL batch size, split evenly over all processes")
    add("--optimizer", choices=["sgd", "adamw"], default="sgd", help="SGD with momentum, or AdamW")
    add("--lr", type=float, default=None, help="peak learning rate (default: sgd 0.1 x batch-size / 256, adamw 1e-3)")
    add("--warmup", type=float, default=0.1, metavar="FRACTION", help="part of the steps the lr rises linearly")
    add("--momentum", type=float, default=0.9, help="SGD momentum")
    add("--weight-decay", type=float, default=None, help="weight decay (default: sgd 5e-4, adamw 0.01)")
    add("--clip-grad", type=float, default=None, metavar="NORM", help="clip the gradients' global norm to NORM")
    add("--workers", type=int, default=None, help="DataLoader workers per process (default: spare cores per GPU)")
    add("--seed", type=int, default=0, help="seed for init, data order and augmentation")
    add("--print-freq", type=int, default=50, help="a progress line and a record in steps.jsonl every N steps")
    add("--eval-every", type=int, default=None, metavar="N", help="also validate every N steps (default: epoch ends)")
    add("--tensorboard", action="store_true", help="rank 0 also writes steps.jsonl's records to OUTPUT_DIR/tensorboard")
    add("--wandb", default=None, metavar="PROJECT", help="rank 0 also logs the records to a Weights & Biases run")
    add("--ema", type=float, metavar="DECAY", help="also validate and save a moving average of the weights (0.999)")
    add("--ip", default=None, help="rendezvous address for tcp:// init (default 127.0.0.1)")
    add("--port", type=int, default=None, help="rendezvous port for tcp:// init")
    add("--dist-url", default=None, help="env://, tcp://HOST:PORT or file:///shared/path (overrides --ip/--port)")
    add("--backend", choices=["nccl", "gloo"], default=None, help="default: nccl with CUDA, else gloo")
    add("--timeout", type=float, default=300,
        help="seconds before a stuck rendezvous fails, or a stalled rank ends every rank, named: from the first "
             "step, no batch or saved byte on any rank for S seconds; before it, a rank that another waited S "
             "seconds for (start-up work itself has no bound)")
    add("--sync-bn", action="store_true", help="synchronise batch-norm statistics over GPUs")
    add("--channels-last", action="store_true", help="NHWC model and images (faster on Tensor Cores)")
    add("--compile", action="store_true", help="compile the model with torch.compile")
    add("--compile-mode", choices=["default", "reduce-overhead", "max-autotune"], help="implies --compile")
    add("--output-dir", default="./output", help="where rank 0 writes checkpoint.pt and metrics.jsonl")
    add("--save-every", type=int, default=None, metavar="N", help="also save a checkpoint every N optimizer steps")
    add("--find-unused-parameters", action="store_true", help="DDP: allow parameters without a gradient in some steps")
    add("--comm-hook", choices=["bf16"], default=None,
        help="DDP: all-reduce the gradients in bfloat16, half the bytes (PyTorch's bf16_compress_hook)")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Catch impossible values before any process group or data is touched; fill machine defaults."""
    for name in ("epochs batch_size fake_size image_size print_freq eval_every stop_after save_every "
                 "steps_per_epoch").split():
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if min(args.workers or 0, args.seed) < 0 or min(args.timeout, args.clip_grad or 1) <= 0 or not 0 <= args.warmup < 1:
        raise UsageError("--workers and --seed must be >= 0, --timeout and --clip-grad > 0, --warmup in [0, 1)")
    if not 0 <= (args.ema or 0) < 1:
        raise UsageError(f"--ema {args.ema:g} is not in [0, 1): the average spans about 1 / (1 - DECAY) steps")
    args.compile = args.compile or args.compile_mode is not None
    for flag, module in (("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb")):
        try:  # before any data or model is built
            getattr(args, flag) and importlib.import_module(module)  # torch.utils.tensorboard imports tensorboard
        except ImportError:
            raise UsageError(f"--{flag} needs the {flag} package: pip install {flag}") from None
    adamw = args.optimizer == "adamw"  # SGD: the linear scaling rule (Goyal et al. 2017), 0.1 per 256 samples
    args.lr = (1e-3 if adamw else 0.1 * args.batch_size / 256) if args.lr is None else args.lr
    args.weight_decay = (0.01 if adamw else 5e-4) if args.weight_decay is None else args.weight_decay
    if torch.cuda.is_available():  # NCCL's Flight Recorder: each rank's last collectives, for a stall's stalls/ folder
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    if args.workers is None:  # the cores each GPU can spare, one kept for the training loop itself
        gpus = torch.cuda.device_count()
        args.workers = min(8, max(0, (os.cpu_count() or 1) // gpus - 2)) if gpus else 0


def first_line(error: BaseException) -> str:  # PyTorch's distributed errors append a C++ stack trace: keep line one
    return (str(error).strip() or type(error).__name__).splitlines()[0]


def raised_in(error: BaseException, *places: str) -> bool:
    """Was error raised (its innermost frame) in one of these files or folders: a library's or ours, not the user's?"""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(places)


def at(error: BaseException) -> str:
    """", at collate (distributed.py:66)": the user's line that called the library that raised error, if any."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = max((i for i, f in enumerate(frames) if f.filename == __file__), default=-1)
    frame = user_frame(frames[ours + 1:])  # below utils' frames: in the user's collate or model, not the script's call
    return f", at {frame.name} ({Path(frame.filename).name}:{frame.lineno})" if frame else ""


class Stopped(Exception):
    """Stopped by a signal after a step all ranks agreed on, and saved there."""

    def __init__(self, signum: int, epoch: int, step: int, steps: int):
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}/{steps} of epoch {epoch + 1}, "
                         f"saved: the same command continues from there")
        self.signum = signum


def write_line(line: str) -> None:
    """A line on stderr in one write(): print() writes the newline apart, so lines of ranks failing at
    once could run together."""
    sys.stderr.write(f"{line}\n")


# Where a run's last line goes: stderr, or distributed_mp.py's parent (run_main's say).
say_line: Callable[[str], object] = write_line


def run_main(main: Callable[[], None], say: Callable[[str], object] = write_line):
    """Run main(); a user's error ends in one line, said (printed, or to distributed_mp.py's parent), exit 1."""
    status: int | str = 0
    global say_line
    say_line = say
    try:
        main()
    except Stopped as e:
        sys.stderr.write(f"{e}\n")
        status = 128 + e.signum  # as a shell reports a process ended by that signal
    except UsageError as e:
        status = f"error: {e}"
    except torch.cuda.OutOfMemoryError:
        status = "error: out of GPU memory: lower --batch-size"
    except KeyboardInterrupt:
        status = "interrupted"
    except (RuntimeError, ConnectionError, TimeoutError) as e:  # DistError is a RuntimeError
        # a worker killed (out of memory, of /dev/shm) or crashed in C code, or a dataset too large for /dev/shm
        worker = str(e).startswith("DataLoader worker") or "unable to write to file </torch_" in str(e)
        # gloo reports a dead peer or a timeout as a plain RuntimeError, raised in torch or here; any other (a
        # stream's own ConnectionError) is a bug, the user's or ours: keep its traceback
        if not (worker or isinstance(e, dist.DistError) or raised_in(e, str(Path(torch.__file__).parent), __file__)
                and re.search(r"gloo|nccl|[Cc]onnection|[Tt]imed out|[Tt]imeout|peer", str(e))):
            status = traceback.print_exc() or 1
        else:
            # PyTorch's own line is the cause where it saw the signal (a forked worker), else the error itself
            said = e.__cause__ if str(e.__cause__).startswith("DataLoader worker") else e
            status = (f"error: {first_line(said).split('. ')[0].rstrip('.')}: lower --workers or --batch-size where "
                      f"memory or /dev/shm ran out (docker run --shm-size), or see a crash with --workers 0" if worker
                      else f"error: distributed communication failed: {first_line(e)}")
    except Exception:  # a bug, the user's or ours: its traceback, then os._exit below (no exit that waits on workers)
        status = traceback.print_exc() or 1
    finally:  # after the except blocks, whose exception kept main's frames (the model, DDP, FSDP) alive
        progress.close()  # a watchdog ending the run (this error followed from the stall) ends it alone
        if (wandb := sys.modules.get("wandb")) and wandb.run:  # its records on disk before os._exit below
            wandb.finish(exit_code=int(status != 0))
        gc.collect()  # free them and their process groups while the interpreter is whole
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if isinstance(status, str):
        say(status)
        status = 1
    # all written or said: end without the interpreter's shutdown, where gloo's threads still abort about one
    # 2-process run in 50 on PyTorch 2.14 ("terminate called without an active exception"), after an error too
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


# --------------------------------------------------------------- logging ----

def setup_logging(rank: int) -> None:  # rank 0 prints progress; other ranks print warnings and errors only
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stdout, force=True,
                        format="%(message)s" if rank == 0 else f"[rank {rank}] %(message)s")


# ----------------------------------------------------------- distributed ----

def check_batch_size(batch_size: int, parts: int, what: str) -> int:
    """The batch of each of parts (described by what); a clear error if it does not split evenly."""
    if batch_size % parts or batch_size < parts:
        raise UsageError(f"--batch-size {batch_size} does not split evenly over {what}: use a multiple of {parts}")
    return batch_size // parts


def rendezvous_store(init_method: str | None, rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
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
    try:  # rank 0 listens on the given address only: TCPStore alone would listen on every interface
        listen_fd = socket.create_server((url.hostname, url.port)).detach() if rank == 0 else None
    except OSError as e:
        reason = ("the port is in use; choose another --port" if e.errno == errno.EADDRINUSE
                  else f"{e.strerror}; the address must be one of this machine (node 0)")
        raise UsageError(f"cannot listen on tcp://{url.hostname}:{url.port}: {reason}") from None
    return dist.TCPStore(url.hostname, url.port, world_size, is_master=rank == 0,
                         timeout=timeout, master_listen_fd=listen_fd)


def fresh_namespace(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """A part of store no earlier group of this job wrote to: rank 0 draws a generation, answers each rank's token."""
    # torchrun keeps its store across worker restarts, whose count differs between nodes (PyTorch issue 135712)
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
        store.set(f"ddp/hello/{rank}", token := uuid.uuid4().hex)
        generation = int(store.get(f"ddp/answer/{token}"))  # waits for rank 0's answer
        store.add(f"ddp/{generation}/joined", 1)
    return dist.PrefixStore(f"ddp/{generation}/", store)


def describe_init_error(error: Exception, init_method: str) -> str:
    """Turn a failed rendezvous into a line that says what to change."""
    text = first_line(error)
    if isinstance(error, (dist.DistStoreError, TimeoutError)) or re.search("timed out|timeout", text, re.I):
        return f"rendezvous at {init_method} timed out: is the address right and every process started? ({text})"
    return f"rendezvous at {init_method} failed: {text}"


def set_cpu_threads(local_world_size: int) -> None:  # processes that share a machine's cores must not each use all
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))


def slurm_master_addr(nodelist: str) -> str:
    """First host of a Slurm node list, compressed or not: 'node[01-04],gpu7' -> 'node01'."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise UsageError(f"cannot read a host from Slurm node list {nodelist!r}")
    prefix, ranges = match.groups()  # node, 01-04
    return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "")


def no_buffer_sync_per_forward() -> dict[str, bool]:
    """DDP's keyword for no buffer broadcast before every forward (forward_sync_buffers since 2.14)."""
    params = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """tensor, in place, summed (or op) over all ranks; as it is in a world of one."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def gathered(obj, group=None) -> list:  # every rank's obj, in rank order (a collective); [obj] in a world of one
    objects = [obj] * (dist.get_world_size(group) if dist.is_initialized() else 1)
    if len(objects) > 1:
        dist.all_gather_object(objects, obj, group=group)
    return objects


def gathered_on_rank_0(obj) -> list | None:  # every rank's obj, its tensors copied to the CPU, on rank 0 alone
    obj = tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), obj)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    objs = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, objs, dst=0)
    return objs


def unwrap(model: nn.Module) -> nn.Module:  # the plain module inside DDP / DataParallel / torch.compile wrappers
    inner = getattr(model, "module", getattr(model, "_orig_mod", None))
    return model if inner is None else unwrap(inner)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: its shard of an FSDP parameter (a DTensor), else the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


# -------------------------------------------------------------- progress ----

class Progress:
    """What the run tells a watcher of its progress: a batch arrived, a save is writing. This one does
    nothing; stalls.Watchdog, which ends a stalled run, takes its place (utils.progress = ...)."""

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
LIBRARIES = tuple({*(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")),
                   str(Path(torch.__file__).parents[1])})
# This file and the optional ones beside it: ours, not the user's.
OURS = tuple(str(Path(__file__).with_name(name)) for name in ("utils.py", "stalls.py", "streams.py"))


def user_frame(frames: list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost frame of the user's code or the script (one of ours if none): not a library's."""
    not_libraries = [f for f in frames if not f.filename.startswith((*LIBRARIES, "<"))]
    for frame in reversed(not_libraries):
        if frame.filename not in OURS:
            return frame
    if not_libraries:
        return not_libraries[-1]
    return None


# ------------------------------------------------ PyTorch's insides we reach ----
# Every private name of PyTorch or Python's multiprocessing that the scripts, utils.py and stalls.py
# use is reached here alone. tests/test_internals.py checks that each exists on the installed
# PyTorch, so an upgrade that renames one fails that test, not a user's run; where one is missing
# all the same, what it serves says so (the stall line names no rank) instead of going wrong.

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
    """Counted(collate): a collate_fn giving (samples, batch), any batch counted as its samples; picklable."""

    def __call__(self, samples: list) -> tuple[int, object]:
        return len(samples), super().__call__(samples)


def forward(model: nn.Module, inputs):
    """A dict of inputs as keyword arguments, as Hugging Face models take them; anything else as one argument."""
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def loss_for_backward(loss) -> torch.Tensor:
    """compute_loss's mean as it is; its (sum, count) as sum x world size / all ranks' count (one small all-reduce)."""
    # DDP and FSDP average the ranks' gradients: that of the mean over every rank's items, whatever each rank's count
    if isinstance(loss, torch.Tensor):
        return loss
    total, count = loss
    count = all_reduce(torch.as_tensor(count, dtype=torch.float64, device=total.device).clone())
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    return total * (world_size / count.clamp(min=1)).to(total.dtype)


def logits(outputs):  # the scores in outputs: themselves, or the logits of a dict or a Hugging Face ModelOutput
    return outputs.get("logits") if isinstance(outputs, Mapping) else getattr(outputs, "logits", outputs)


def class_indices(outputs, targets) -> bool:
    """Are targets class indices for scores at outputs' dim 1 (classification, per-pixel classification)?"""
    return (isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor) and outputs.is_floating_point()
            and not (targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool)
            and outputs.dim() == targets.dim() + 1 and outputs.shape[:1] + outputs.shape[2:] == targets.shape)


# ------------------------------------------------------------------ data ----

def batch_to_device(batch, device: torch.device, dataset: Dataset, channels_last: bool = False,
                    key: tuple[int, int] | None = None):
    """(inputs, targets) of any structure on the device; a dataset's batch_transform finishes the inputs there. Each
    call is progress for the watchdog: key, (epoch, step), for a training batch, None for a validation one."""
    progress.batch(key)
    inputs, targets = batch
    inputs = dict(inputs) if isinstance(inputs, Mapping) else inputs  # a tokenizer's BatchEncoding: a plain dict
    inputs, targets = tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), (inputs, targets))
    if (transform := getattr(dataset, "batch_transform", None)) is not None:  # the built-in images' fast path
        inputs = transform(inputs, key)
    if channels_last and isinstance(inputs, torch.Tensor) and inputs.dim() == 4:
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    return inputs, targets


class StreamSampler:
    """A stream read in the main process as global batches, each of the next size / V samples of V fixed readers (V of
    its shards where it has them): this rank's share of each (in micro-batches of part samples under accumulation),
    lists of samples that a DataLoader worker collates. Each rank reads only the readers its share overlaps; once one
    reader has ended (shards of different sizes), the rest of every reader, still read by one rank alone, goes to
    every rank, and global batches are cut from it: every sample of an epoch is trained on once."""

    def __init__(self, stream: IterableDataset, part: int, rank: int, world_size: int, train: bool = True,
                 micro_batches: int = 1):
        self.stream, self.part, self.rank, self.train, self.micro = stream, part, rank, train, micro_batches
        self.share, self.size = part * micro_batches, part * micro_batches * world_size  # a step's, this rank's
        shards, self.epoch = getattr(stream, "n_shards", 1) if hasattr(stream, "shard") else 1, 0
        # training: readers of equally many shards that divide the global batch, whatever the processes; validation
        # (every sample once, no batch to keep alike): a reader a rank where the shards split so, else the whole
        self.readers = math.gcd(self.size, shards) if train else world_size if shards % world_size == 0 else 1
        # the ranks learn of a reader that ended, and share the rest, in a group of their own (gloo: CPU objects)
        self.group = dist.new_group(backend="gloo") if train and self.readers > 1 and world_size > 1 else None

    def set_epoch(self, epoch: int) -> None:  # a new order each epoch: passed on to the stream's own set_epoch
        self.epoch = epoch

    def __len__(self) -> int:  # batches (micro-batches); a TypeError for a stream without __len__
        return len(self.stream) // self.size * self.micro if self.train else -(-len(self.stream) // self.size)

    def reader(self, v: int):  # the stream's v-th part of self.readers, at this epoch
        reader = self.stream.shard(self.readers, v) if self.readers > 1 else self.stream
        if hasattr(reader, "set_epoch"):
            reader.set_epoch(self.epoch)
        return reader

    def __iter__(self):
        chunk = self.size // self.readers  # each reader's samples in a global batch; this rank's share overlaps:
        first, end = self.rank * self.share // chunk, -(-(self.rank + 1) * self.share // chunk)
        readers, start = {v: iter(self.reader(v)) for v in range(first, end)}, self.rank * self.share - first * chunk
        while True:
            chunks = {v: list(itertools.islice(reader, chunk)) for v, reader in readers.items()}
            full = self.agreed(all(len(c) == chunk for c in chunks.values()))  # on every rank: none has ended
            samples = [sample for c in chunks.values() for sample in c][start:start + self.share]
            if full or (samples and not self.train):  # validation: an incomplete last batch too
                yield from self.micro_batches(samples)
            if not full:
                break
        if self.train:  # training goes on with the rest of every reader; an incomplete last global batch is dropped
            rest = self.rest(readers, chunks, chunk)
            while len(batch := list(itertools.islice(rest, self.size))) == self.size:
                yield from self.micro_batches(batch[self.rank * self.share:(self.rank + 1) * self.share])

    def micro_batches(self, share: list):
        return (share[i:i + self.part] for i in range(0, len(share), self.part))

    def agreed(self, full: bool) -> bool:  # has every rank read a full chunk of each of its readers? (a collective)
        return bool(all_reduce(torch.tensor([int(full)]), dist.ReduceOp.MIN, self.group)) if self.group else full

    def rest(self, readers: dict, chunks: dict, chunk: int):
        """The samples after the first reader ended, alike on every rank: from each reader that has more, in reader
        order, its next chunk, in turns. Each reader is read by the first rank that reads it, which sends the turn's
        chunks to all (a collective a turn): each sample is still read once."""
        mine = {v: c for v, c in chunks.items() if v * chunk // self.share == self.rank}  # readers this rank sends
        while True:
            turn = {v: c for part in (gathered(mine, self.group) if self.group else [mine]) for v, c in part.items()}
            for v in sorted(turn):
                yield from turn[v]
            mine = {v: list(itertools.islice(readers[v], chunk)) for v, c in mine.items() if len(c) == chunk}
            if not any(len(c) == chunk for c in turn.values()):  # every reader has ended
                return

    def first(self, n: int) -> list:
        """The first reader's first n samples, alike on every rank (a collective), or else the stream splits itself."""
        try:
            samples = list(itertools.islice(self.reader(0), n))
        except ValueError as e:  # webdataset's default node splitter refuses a second process; any other: the user's
            if "nodesplitter" not in str(e):
                raise
            raise UsageError(f"the stream cannot be read ({first_line(e)}): give every process all of it") from None
        try:  # tensors compared by value: their pickles differ between processes
            digest = hashlib.sha256(pickle.dumps(tree_map_only(torch.Tensor, torch.Tensor.tolist, samples))).digest()
        except (pickle.PicklingError, TypeError, AttributeError):  # samples no worker could take either: unchecked
            digest = b""
        if len(set(gathered(digest))) > 1:
            raise UsageError("the stream gives the processes different first samples: it must give every process "
                             "all of it, in the same order (no split_dataset_by_node, no webdataset split_by_node): "
                             "the script splits it")
        return samples


class Samples(Dataset):  # a StreamSampler's "index" is its list of samples: the worker collates it as it is
    def __getitem__(self, samples: list) -> list:
        return samples


def steps_per_epoch(loader: DataLoader, args, micro_batches: int = 1) -> int:
    """Optimizer steps in an epoch: the loader's full batches, cut at --steps-per-epoch (a stream without len's)."""
    try:
        batches = len(loader) // micro_batches
    except TypeError as e:  # a stream without __len__ (len() refused it here): an epoch is one pass, cut at N steps
        if not raised_in(e, __file__):  # in the stream's own __len__: the user's error
            raise
        if not args.steps_per_epoch:
            raise UsageError("the training set is a stream without __len__: give --steps-per-epoch N, the "
                             "optimizer steps of an epoch") from None
        batches = args.steps_per_epoch
    return min(batches, args.steps_per_epoch or batches)


def epoch_loader(loader: DataLoader, skip: int) -> DataLoader:
    """The loader without its first skip batches (a run continued mid-epoch); call its sampler's set_epoch first."""
    # the indices after them in this epoch's order; a stream's batches are read again, not collated
    rest = itertools.islice(loader.sampler, skip * (loader.batch_size or 1), None)
    return DataLoader(loader.dataset, loader.batch_size, sampler=rest, drop_last=loader.drop_last,
                      collate_fn=loader.collate_fn, num_workers=loader.num_workers, pin_memory=loader.pin_memory,
                      generator=loader.generator, worker_init_fn=loader.worker_init_fn,
                      multiprocessing_context=loader.multiprocessing_context) if skip else loader


def first_samples(loader: DataLoader, n: int) -> list:
    """The first n samples of this rank's loader (a stream's first): for the start-up step, or a spare batch."""
    if isinstance(loader.sampler, StreamSampler):
        return loader.sampler.first(n)
    # a share of nothing (a validation sampler with no index): the first of the set
    return [loader.dataset[i] for i in itertools.islice(loader.sampler or range(len(loader.dataset)), n)]


# -------------------------------------------------- metering and records ----

class Meter:
    """An epoch's sums on this rank (loss, its items, correct and scored class targets, samples), time, data wait."""

    def __init__(self, device: torch.device, saved: dict | None = None, rank: int = 0):
        # continued mid-epoch: rank 0 holds what all ranks had summed at the checkpoint, so records go on as before
        self.before, self.recorded = (saved["sums"], saved["recorded"]) if saved else (torch.zeros(5).double(),) * 2
        self.sums = (self.before if rank == 0 else torch.zeros(5).double()).to(device, copy=True)
        self.start, self.data_wait, self.waited, self.pairs = time.perf_counter(), 0.0, 0.0, False  # waited: recorded
        self.mark = (self.start, self.before)  # when, and at which sums, the last record read the speed

    def update(self, loss, outputs, targets, samples: int) -> None:
        # items: what the loss is a mean over, samples for a mean, the count of a (sum, count) pair
        self.pairs = not isinstance(loss, torch.Tensor)
        total, items = loss if self.pairs else (loss * samples, samples)
        # accuracy: None where targets are not class indices
        scores, correct, scored = logits(outputs), self.sums.new_zeros(()), self.sums.new_zeros(())
        if class_indices(scores, targets) and scores.shape[1] > 1:
            valid = (targets >= 0) & (targets < scores.shape[1])  # not a segmentation's "ignore" label
            correct, scored = ((scores.argmax(1) == targets) & valid).sum(), valid.sum()
        values = (total.detach(), items, correct, scored, samples)
        self.sums += torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.sums.device) for v in values])

    def reduced(self) -> torch.Tensor:
        """The sums over all ranks, on the CPU; a collective: every rank calls it at the same step."""
        return all_reduce(self.sums.clone()).cpu()

    def reduce(self, sums: torch.Tensor | None = None) -> tuple[float, float | None, int]:
        """(mean loss per item, accuracy or None, samples) of sums, by default all ranks' (a collective)."""
        loss_sum, items, correct, scored, samples = (self.reduced() if sums is None else sums).tolist()
        return loss_sum / max(items, 1), correct / scored if scored else None, int(samples)

    def since_record(self) -> dict:
        """Loss, accuracy and speed (items of a (sum, count) loss too) since the last record, and the longest wait of
        a rank for its data and that rank (the slow one); a collective."""
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        waits = torch.zeros(world, dtype=torch.float64, device=self.sums.device)
        waits[rank] = self.data_wait - self.waited  # each rank its own place: the sum holds every rank's exactly
        # one collective for both; the sums apart, in a tensor of their own that a checkpoint keeps as it is
        now, waits = (part.clone() for part in all_reduce(torch.cat([self.sums, waits])).cpu().split([5, world]))
        seconds, before = time.perf_counter() - self.mark[0], self.mark[1]
        loss, acc, _ = self.reduce(now - self.recorded)
        _, items, _, _, samples = (now - before).tolist()
        self.recorded, self.mark, self.waited = now, (time.perf_counter(), now), self.data_wait
        return dict(train_loss=loss, train_acc=acc, images_per_s=samples / seconds,
                    **({"items_per_s": items / seconds} if self.pairs else {}),
                    data_wait_max_s=waits.max().item(), data_wait_rank=int(waits.argmax()))

    def totals(self) -> dict:
        """The epoch's loss and accuracy over all ranks (a collective), its time and this run's speed."""
        (loss, acc, samples), seconds = self.reduce(), time.perf_counter() - self.start
        return dict(train_loss=loss, train_acc=acc, epoch_time_s=seconds,
                    images_per_s=(samples - self.before[4].item()) / seconds, data_wait_s=self.data_wait)

    def timed(self, iterable):  # yield from iterable, adding the time each item took to arrive to data_wait
        t = time.perf_counter()
        for item in iterable:
            self.data_wait += time.perf_counter() - t
            yield item
            t = time.perf_counter()


class StepRecords:
    """steps.jsonl (TensorBoard, W&B) by rank 0: all ranks' numbers every few steps; continued, as if never stopped."""

    def __init__(self, output_dir: Path, args, rank: int, steps_per_epoch: int):
        self.path, self.args, self.rank, self.steps_per_epoch = output_dir / "steps.jsonl", args, rank, steps_per_epoch
        # what a checkpoint holds (its shape: a sharded checkpoint loads into it); a W&B run id alike on every rank
        self.saved = {"sums": torch.zeros(5).double(), "recorded": torch.zeros(5).double(),
                      "wandb_id": gathered(uuid.uuid4().hex[:12])[0]}
        self.meter, self.writer, self.wandb = None, None, None

    def meter_for_epoch(self, device: torch.device, first_step: int) -> Meter:
        self.meter = Meter(device, self.saved if first_step else None, self.rank)
        return self.meter

    def state_dict(self) -> dict:  # the epoch's sums for a checkpoint, over all ranks: a collective
        progress = {"sums": self.meter.reduced(), "recorded": self.meter.recorded} if self.meter else {}
        return {**self.saved, **progress}

    def load_state_dict(self, state: dict) -> None:
        self.saved = state

    def start(self, epoch: int, step: int) -> None:
        """On rank 0: keep the records up to the checkpoint's epochs and steps done; TensorBoard purges the rest. W&B,
        which cannot, continues the same run; a kill may have cost it what it got in its last seconds (its service
        writes them every few seconds, and dies with the rank), so it gets every record kept again, in order: none
        missing, some twice with the same values."""
        last, kept = {"epoch": epoch, "global_step": epoch * self.steps_per_epoch + step}, {}
        for path, key in ((self.path.with_name("metrics.jsonl"), "epoch"), (self.path, "global_step")):
            lines = list(filter(None, path.read_text().splitlines())) if path.exists() else []  # no blank line
            kept[key] = [line for line in lines if json.loads(line)[key] <= last[key]]
            if kept[key] != lines:
                write_atomically(path, "".join(f"{line}\n" for line in kept[key]).encode())  # a full disk loses none
        if self.args.tensorboard:  # imported only when asked for
            tb = importlib.import_module("torch.utils.tensorboard")
            self.writer = tb.SummaryWriter(self.path.with_name("tensorboard"), purge_step=last["global_step"] + 1)
        if self.args.wandb:  # every record a row at once, plotted against its global_step (not W&B's own count)
            wandb = importlib.import_module("wandb")
            try:
                self.wandb = wandb.init(project=self.args.wandb, id=self.saved["wandb_id"], resume="allow",
                                        config=vars(self.args), dir=self.path.parent)
            except wandb.errors.Error as e:  # not logged in, no network: ends every rank, in one line
                raise UsageError(f"--wandb cannot start its run ({first_line(e)}): wandb login, or set "
                                 f"WANDB_MODE=offline") from None
            self.wandb.define_metric("*", step_metric="global_step")
            self.replay(*([json.loads(line) for line in kept[key]] for key in ("global_step", "epoch")))

    def replay(self, records: list[dict], epochs: list[dict]) -> None:  # to W&B: each epoch's line after its records
        for record in records:
            while epochs and epochs[0]["epoch"] < record["epoch"]:
                self.epoch_to_wandb(epochs.pop(0))
            self.to_wandb({k: v for k, v in record.items() if k not in ("epoch", "step", "global_step")},
                          record["global_step"])
        for record in epochs:
            self.epoch_to_wandb(record)

    def train(self, epoch: int, step: int, lr: float, grad_norm: torch.Tensor, **more: float) -> None:
        """A training record (a collective: every rank calls it at the same step); a diverged run stops here."""
        record = dict(**self.meter.since_record(), lr=lr, grad_norm=float(grad_norm),
                      peak_mem_mb=peak_memory_mb(self.meter.sums.device), **more)
        check_finite(None, epoch, step, record, self.args)
        left = self.args.batch_size / record["images_per_s"] * (self.steps_per_epoch - step)
        self.add(epoch, step, record, f" left {datetime.timedelta(seconds=int(left))}")

    def add(self, epoch: int, step: int, values: dict, suffix: str = "") -> None:
        """A record of values at this step, and its console line; a collective: a failed write ends all ranks."""
        log.info(f"epoch {epoch + 1}/{self.args.epochs} step {step}/{self.steps_per_epoch} {numbers(values)}{suffix}")
        global_step = epoch * self.steps_per_epoch + step
        with errors_shared_by_all_ranks():  # a full disk ends every rank with one line
            if self.rank == 0:  # one writer: the numbers are all ranks' already (the others log warnings only)
                append_metrics(self.path, dict(epoch=epoch + 1, step=step, global_step=global_step, **values))
                self.to_wandb(values, global_step)
            if self.writer:  # rank 0's curves: each value at its global step
                for key in [key for key, value in values.items() if value is not None]:
                    self.writer.add_scalar(key, values[key], global_step)
                self.writer.flush()  # on disk before a later checkpoint: a kill loses no point the checkpoint keeps

    def epoch(self, record: dict) -> None:
        """On rank 0: the epoch's line in metrics.jsonl (whole or not at all), in W&B at its last step, then printed."""
        append_metrics(self.path.with_name("metrics.jsonl"), record)
        self.epoch_to_wandb(record)
        shown = numbers(record, "train_loss", "train_acc", "val_loss", "val_acc", "val_acc_ema")
        log.info(f"epoch {record['epoch']}/{self.args.epochs} {shown} time {record['epoch_time_s']:.1f}s "
                 f"{record['images_per_s']:.0f} img/s")

    def epoch_to_wandb(self, record: dict) -> None:  # at the epoch's last step, under epoch/
        self.to_wandb({f"epoch/{key}": value for key, value in record.items()}, record["epoch"] * self.steps_per_epoch)

    def to_wandb(self, values: dict, global_step: int) -> None:
        if self.wandb:
            self.wandb.log({"global_step": global_step, **{k: v for k, v in values.items() if v is not None}})


def numbers(record: dict, *keys: str) -> str:  # "key value ..." of keys (all by default); losses and accuracies
    return " ".join(f"{k} {record[k]:.4{'f' if re.search('(loss|acc)(_ema)?$', k) else 'g'}}" for k in keys or record
                    if record.get(k) is not None)  # to 4 decimals, the rest to 4 digits


def peak_memory_mb(device: torch.device) -> float:  # this rank's: on a GPU allocated, on the CPU resident (KiB)
    return (torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def memory_mb(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> dict[str, float]:
    """MB: peak memory; parameters, gradients, optimizer state held by this rank."""
    mb = lambda tensors: sum(local(t).numel() * local(t).element_size() for t in tensors) / 2**20  # noqa: E731
    params = list(model.parameters())
    return dict(peak_mem_mb=peak_memory_mb(device), params_mb=mb(params),
                grads_mb=mb(p for p in params if p.requires_grad),
                optimizer_mb=mb(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)))


# ---------------------------------- checks: one line for what would fail ----

def check_finite(model: nn.Module | None, epoch: int, step: int, record: dict | None, args) -> None:
    """A NaN or infinite loss or weight ends the run before a progress line (model None) or a save shows or keeps it."""
    finite = all(math.isfinite(value) for key, value in (record or {}).items() if key.endswith("_loss"))
    if finite and (model is None or all(local(p).isfinite().all() for p in model.parameters())):
        return
    where = f"by step {step} of epoch {epoch + 1}" if step else f"in epoch {epoch}"
    clip = "" if args.clip_grad else ", or use --clip-grad"
    raise UsageError(f"training diverged: the loss or the weights became NaN or infinite {where}: lower --lr (peak "
                     f"{args.lr:.4g}) or lengthen --warmup ({args.warmup:g}){clip}; only finite checkpoints were saved")


def check_first_step(model: nn.Module, loader: DataLoader, compute_loss: Callable, args, device: torch.device,
                     unused_ok: bool) -> float:
    """A step of two samples, undone: what would fail or learn nothing ends every rank with one line; FLOPs/sample."""
    # float32 whatever the training's precision: two samples are small
    buffers = [b.clone() for b in model.buffers()]  # batch-norm statistics, put back afterwards
    # FLOPs counted around the model and loss only: FlopCounterMode would see our own collectives too
    with torch.random.fork_rng([torch.cuda.current_device()] if torch.cuda.is_available() else []):
        # one rank's error ends every rank with its line; before backward(), a collective under FSDP
        with errors_shared_by_all_ranks():
            check_workers_can_take(loader)
            # two samples for the step, more for the labels' check below (a stream's: its first reader's)
            first = first_samples(loader, 256)
            try:  # what a library refused (default_collate: samples of two sizes) is one line; the user's own error
                (samples, batch), more = loader.collate_fn(first[:2]), loader.collate_fn(first)[1]  # is theirs
            except (RuntimeError, ValueError, TypeError, IndexError, KeyError) as e:
                if not raised_in(e, *LIBRARIES):
                    raise
                raise UsageError(f"collate cannot batch the first samples ({first_line(e)}{at(e)}): pad them"
                                 ) from None
            inputs, targets = batch_to_device(batch, device, loader.dataset, args.channels_last)
            try:
                with FlopCounterMode(display=False) as forward_flops:
                    outputs = forward(model.train(), inputs)
            except (RuntimeError, ValueError, AssertionError, TypeError, IndexError) as e:
                if not raised_in(e, *LIBRARIES):
                    raise
                raise UsageError(f"the model cannot take the first batch's inputs: {first_line(e)}{at(e)}") from None
            # on a GPU a bad label is a device-side assert that kills the process: more labels than two samples have
            if is_default_loss(compute_loss):
                check_class_targets(outputs, batch_to_device(more, device, loader.dataset)[1])
            loss = compute_loss(outputs, targets)
            check_loss(loss)
        with FlopCounterMode(display=False) as backward_flops:
            (loss if isinstance(loss, torch.Tensor) else loss[0]).backward()
    unused = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    model.zero_grad(set_to_none=True)
    for buffer, saved in zip(model.buffers(), buffers):
        buffer.copy_(saved)
    if unused and not unused_ok:  # alike on every rank: the same model and code
        names = ", ".join(unused[:3]) + (", ..." if len(unused) > 3 else "")
        raise UsageError(f"{len(unused)} parameters get no gradient ({names}): --find-unused-parameters lets DDP "
                         f"train such a model, or leave them out of it")
    return (forward_flops.get_total_flops() + backward_flops.get_total_flops()) / samples


def check_workers_can_take(loader: DataLoader) -> None:
    """DataLoader workers start from a forkserver: the Dataset and collate must pickle (no lambda, no open file)."""
    class Sink:  # the pickle is thrown away: a worker's share is all that is checked
        write = staticmethod(len)

    class Pickler(pickle.Pickler):  # tensors go to workers through shared memory, unpickled
        def persistent_id(self, obj):
            return id(obj) if isinstance(obj, torch.Tensor) else None
    try:
        if loader.num_workers:
            Pickler(Sink()).dump((loader.dataset, loader.collate_fn))
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise UsageError(f"the Dataset or collate cannot go to a DataLoader worker ({first_line(e)}): define their "
                         f"functions at module level, not as a lambda or inside a function, or use --workers 0"
                         ) from None


def check_loss(loss) -> None:  # compute_loss gives a scalar (the batch's mean) or a pair (a scalar sum, its count)
    pair = isinstance(loss, (tuple, list)) and len(loss) == 2
    total, count = loss if pair else (loss, 1)
    if not (isinstance(total, torch.Tensor) and total.dim() == 0 and (isinstance(count, int) or (
            isinstance(count, torch.Tensor) and count.numel() == 1))):
        describe = lambda x: f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__  # noqa
        what = f"({describe(total)}, {describe(count)})" if pair else describe(loss)
        raise UsageError(f"compute_loss must return a scalar tensor or a (sum, count) pair, not {what}: reduce it, "
                         f"e.g. with .mean()")


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


def is_default_loss(compute_loss: Callable) -> bool:
    """Is compute_loss the default F.cross_entropy(outputs, targets), with no other name or constant (ignore_index=)?"""
    code = getattr(compute_loss, "__code__", None)
    return (code is not None and code.co_names == ("F", "cross_entropy")
            and set(code.co_consts) <= {None, compute_loss.__doc__})


# ----------------------------------- optimizer, schedule, weight average ----

def build_optimizer(params, args) -> torch.optim.Optimizer:
    """--optimizer with its peak lr and weight decay (check_args fills their defaults)."""
    # AdamW fused: each tensor in one pass, where foreach (the default) makes a temporary copy of all the weights;
    # not with float16 (FSDP's gradient scaler checks overflow on all ranks on the foreach path only), nor for SGD
    # (FSDP's shards have no fused SGD)
    if args.optimizer == "adamw":
        fused = getattr(args, "amp_dtype", None) != "float16" or None
        return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, fused=fused)
    return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)


def warmup_cosine(optimizer: torch.optim.Optimizer, steps: int, warmup: float) -> torch.optim.lr_scheduler.LambdaLR:
    """A linear rise over the first `warmup` part of `steps`, then a cosine decay to 0; stepped per step."""
    rise = max(1, round(warmup * steps))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (step + 1) / rise if step < rise else
                                             0.5 * (1 + math.cos(math.pi * (step - rise) / max(1, steps - rise))))


class EMA:
    """--ema DECAY: a moving average of the weights and buffers, updated after each optimizer step on every rank
    (under FSDP each its own shards), validated and saved beside them. Its decay is min(DECAY, (1 + n) / (10 + n))
    at update n (TensorFlow's num_updates): the first weights fade fast. Without --ema it does nothing."""

    def __init__(self, model: nn.Module, decay: float | None):
        self.model, self.decay, self.updates = unwrap(model), decay, 0
        self.average = {name: t.detach().clone() for name, t in self.named().items()} if decay is not None else {}

    def named(self) -> dict[str, torch.Tensor]:  # by plain name (no DDP "module."), each once (a tied head is one)
        return dict([*self.model.named_parameters(), *self.model.named_buffers()])

    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:  # (average, weight): this rank's part of each
        named = self.named()
        return [(local(average), local(named[name]).detach()) for name, average in self.average.items()]

    @torch.no_grad()
    def update(self) -> None:
        self.updates += 1
        weight = 1 - min(self.decay or 0, (1 + self.updates) / (10 + self.updates))
        for average, live in self.pairs():  # integers (batch-norm's count) as they are
            average.lerp_(live, weight) if average.is_floating_point() else average.copy_(live)

    @contextlib.contextmanager
    def swapped(self):  # the model holds the average within, then its own weights again, bit for bit
        self.swap()
        yield  # an error in it ends the run: no step is ever taken on the average
        self.swap()

    @torch.no_grad()
    def swap(self) -> None:  # a tensor at a time: no second copy of the model
        for average, live in self.pairs():
            kept = live.clone()
            live.copy_(average)
            average.copy_(kept)

    def evaluated(self, evaluate: Callable[[], dict]) -> dict:  # evaluate()'s record; with --ema the average's too
        record = evaluate()
        if self.average:
            with self.swapped():
                record.update({f"{key}_ema": value for key, value in evaluate().items() if key != "val_images"})
        return record

    def state_dict(self) -> dict:
        return {"updates": self.updates, "average": self.average}

    def load_state_dict(self, state: dict) -> None:
        if state["average"].keys() != self.average.keys():
            raise ValueError("its --ema is not this run's")
        # a sharded checkpoint has loaded into the average itself; checkpoint.pt's tensors go to its device
        self.updates, self.average = state["updates"], {name: tensor.to(self.average[name].device)
                                                         for name, tensor in state["average"].items()}


# ---------------------------------------- stops, checkpoints and metrics ----

class StopSignal:
    """Notes SIGTERM and SIGUSR1 (preemption, Slurm's --signal) instead of dying at once; all ranks agree on steps."""

    def __init__(self):
        self.signal, self.work, self.flags = 0, None, torch.zeros(2, dtype=torch.long)
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(signum, lambda received, frame: setattr(self, "signal", received))
        # with GPUs the flags go over the CPU: no GPU synchronisation every step
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() and dist.get_backend() != "gloo" else None

    def agreed(self) -> tuple[int, bool]:
        """(the signal of any rank or 0, does some rank lack the next batch), as they were when this step began."""
        if self.work:  # once a step, after its backward: the all-reduce is done by then
            self.work = self.work.wait() and None  # waited for: nothing left to wait for
        return int(self.flags[0]), bool(self.flags[1])

    def steps(self, batches, first_step: int, steps: int):
        """(step, batch) up to steps while every rank has a batch, read one ahead: the same steps on every rank."""
        batches, step, batch = iter(batches), first_step, None
        ahead = next(batches, None) if step < steps else None
        while True:  # each step starts the all-reduce that agreed() waits for
            self.flags = torch.tensor([self.signal, int(ahead is None)])
            self.work = dist.is_initialized() and dist.all_reduce(self.flags, dist.ReduceOp.MAX, self.group, True)
            if step > first_step:
                yield step, batch
            if self.agreed()[1]:  # a stream that ended early, or on one rank sooner: all end the epoch here
                break
            step, batch, ahead = step + 1, ahead, next(batches, None) if step + 1 < steps else None
        if step == 0:
            raise UsageError("the training data gave no full batch this epoch: lower --batch-size or use more data")


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
    if any(errors := gathered(error)):
        raise UsageError(next(e for e in errors if e))


def check_output_dir(path: Path) -> None:
    """Create the output directory and prove that it takes a file, before any data or model is built."""
    path.mkdir(parents=True, exist_ok=True)
    tempfile.TemporaryFile(dir=path).close()


def save_checkpoint(state: dict, path: Path) -> None:  # atomically, straight into the file: no copy in memory
    write_atomically(path, functools.partial(torch.save, state))


def write_atomically(path: Path, data: bytes | Callable) -> None:
    """data, or what data(file) writes, at path: a crash or a full disk mid-write leaves the previous file and no
    temporary file; a failed write is an OSError that names path."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with progress.writing(path, tmp), open(tmp, "wb") as f:
            data(f) if callable(data) else f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        tmp.unlink(missing_ok=True)
        # torch.save's zip writer fails again, at its end of file, after a failed write: that write's error is why
        error = e.__context__ if isinstance(e, RuntimeError) else e
        if not isinstance(error, OSError):
            raise
        raise OSError(error.errno, error.strerror, str(path)) from None


def load_checkpoint_everywhere(path: Path, rank: int) -> dict | None:
    """The checkpoint at path or None; rank 0 reads it and sends it to all (no shared file system needed)."""
    # a tensor at a time, so that no rank holds a second copy: sent as one pickled object, receivers held it 4 times
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
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return state
    leaves, spec = tree_flatten(state)
    box = [[t.to("meta") if torch.is_tensor(t) else t for t in leaves], spec]  # each tensor as its shape and dtype
    dist.broadcast_object_list(box, src=0)
    group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None  # the tensors stay on the CPU
    for i, leaf in enumerate(box[0]):
        if torch.is_tensor(leaf):
            box[0][i] = leaves[i].contiguous() if rank == 0 else torch.empty(leaf.shape, dtype=leaf.dtype)
            dist.broadcast(box[0][i], src=0, group=group)
    return tree_unflatten(*box)


def rng_states() -> dict:
    """The global random streams (dropout's; alike on all ranks): a continued run draws what a straight one would."""
    cuda = {"cuda_rng": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {}
    return {"rng": torch.get_rng_state(), **cuda}


def restore(state: dict, path: Path | str, args, **stateful) -> tuple[int, int]:
    """Load stateful (model, optimizer, scheduler, scaler) and the random streams; say so: (epochs, steps) done."""
    for flag, saved, value in (("--arch", state.get("arch"), args.arch),
                               ("--optimizer", state.get("optimizer_name"), args.optimizer)):
        if saved not in (None, value):  # one line, not a failed load or step
            raise UsageError(f"{path} was written with {flag} {saved}, not {flag} {value}: use another --output-dir")
    try:
        for name, obj in stateful.items():
            obj.load_state_dict(state[name])
        torch.set_rng_state(state.get("rng", torch.get_rng_state()))
        if "cuda_rng" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda_rng"])
    except (RuntimeError, KeyError, ValueError) as e:
        raise UsageError(f"{path} does not fit this model or these flags ({first_line(e)}): "
                         f"use another --output-dir") from None
    epoch, step = state["epoch"], state.get("step", 0)
    log.info(f"continuing from {path}: {epoch} of {args.epochs} epochs done"
             + (f" and {step} steps of the next" if step else ""))
    return epoch, step


def save_pretrained(model: nn.Module, directory: Path, state: dict | None = None) -> None:
    """A Hugging Face model as its save_pretrained writes it (a PEFT model: the adapter alone), for from_pretrained:
    from state, its whole weights with plain keys, where the model holds shards; in place once complete."""
    if hasattr(model, "save_pretrained"):  # any other model: model.pt or checkpoint.pt is all
        new = directory.with_name(directory.name + ".new")
        with progress.writing(directory, new):
            model.save_pretrained(new, state_dict=model.state_dict() if state is None else state)
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(new, directory)


def append_metrics(path: Path, record: dict) -> None:  # a JSON line, whole or not at all, for a continued run
    line = (json.dumps(record) + "\n").encode()
    with open(path, "ab", buffering=0) as f:  # one write
        size = f.tell()
        try:
            if f.write(line) < len(line):  # what fitted: the disk is full
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            f.truncate(size)
            raise OSError(e.errno, e.strerror, str(path)) from None
