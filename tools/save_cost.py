"""What a checkpoint save costs the training loop: the seconds the loop is stopped and the seconds the write takes,
written the way the scripts wrote it before (the loop waits for the last byte) and the way they write it now
(extras.checkpoints.Saves: a copy in host memory, written by a thread while training goes on), for the state the
scripts save: the weights, the optimizer's state and the moving average.

    python tools/save_cost.py                  # the main job's ResNet-18 (SGD) and GPT-2 small (AdamW), rank 0's file
    python tools/save_cost.py --dir /scratch   # on another disk

Rows: the DDP scripts' one file on rank 0 (extras.checkpoints.save_checkpoint before); GPT-2 small sharded over 2
processes, each writing its shards as distributed_fsdp.py does (its save_sharded: DCP's dcp.save, in the loop
before, in the writing thread now, its collectives over a gloo group of their own), the slowest rank's times. Each
row is the median of --repeats saves into --dir (the first makes the host copies, the others reuse them, as a run's
saves do), each file fsync'ed as the scripts do.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torchvision  # noqa: E402

from extras import averages, checkpoints  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class Unwatched:
    """A watchdog that watches nothing: the saves' times alone."""

    def writing(self, path, growing=None):
        return contextlib.nullcontext()

    def save_taken(self) -> None:
        pass


def trained_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(checkpoint.pt's state, model_ema.pt's) after one step, so that the optimizer holds its moments."""
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    average = copy.deepcopy(model.state_dict())
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "ema": average}
    return state, average


def main_job() -> tuple[dict, dict]:
    model = torchvision.models.resnet18(num_classes=100)
    return trained_state(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def gpt2_small() -> tuple[dict, dict]:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config())
    return trained_state(model, torch.optim.AdamW(model.parameters(), lr=1e-4))


def megabytes(state: dict) -> float:
    """Its tensors' size, each once (a rank's shards of a sharded one)."""
    unique = checkpoints.each_tensor_once(torch.utils._pytree.tree_flatten(state)[0])
    return sum(t.numel() * t.element_size() for t in unique.values()) / 2**20


def row(name: str, size: float, t: dict) -> None:
    print(
        f"| {name} | {size:,.0f} | {t['before']:.2f} s | {t['stopped']:.3f} s "
        f"({t['stopped'] / t['before']:.2f}x) | {t['written']:.2f} s |"
    )


def measure(files: dict[Path, dict], repeats: int) -> dict:
    """Seconds the loop stops, and seconds until the files are on disk, before and now (medians)."""
    before, stopped, written = [], [], []
    # one Saves for the run, as in the scripts: from the second save on, its host copies are reused
    with checkpoints.Saves() as saves:
        for _ in range(repeats):
            start = time.perf_counter()
            for path, state in files.items():
                checkpoints.save_checkpoint(state, path)
            before.append(time.perf_counter() - start)
            start = time.perf_counter()
            for path, state in files.items():
                saves.save(state, path)
            stopped.append(time.perf_counter() - start)
            saves.wait()
            written.append(time.perf_counter() - start)
    return dict(
        before=statistics.median(before),
        stopped=statistics.median(stopped),
        written=statistics.median(written),
    )


def fsdp_rank(rank: int, folder: str, repeats: int, port: int, times) -> None:
    """One of 2 processes: GPT-2 small sharded, one AdamW step and a moving average, then its sharded state saved
    as distributed_fsdp.py saved it before and as it saves it now; its medians put in times."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)  # as torchrun sets OMP_NUM_THREADS for each of its processes
    spec = importlib.util.spec_from_file_location("distributed_fsdp", ROOT / "distributed_fsdp.py")
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # its dataclass looks its module up
    spec.loader.exec_module(script)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config())
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    state = {
        "model": checkpoints.without_ties(get_model_state_dict(model), model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
        "ema": averages.EMA(model, 0.999).state_dict(),
    }
    directory, watchdog = Path(folder) / "checkpoint", Unwatched()
    write = functools.partial(script.save_sharded, group=dist.new_group(backend="gloo"))
    before, stopped, written = [], [], []
    with checkpoints.Saves() as saves:
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            script.save_sharded(state, directory, watchdog, dist.group.WORLD)
            before.append(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()
            saves.save(state, directory, watchdog, write)
            stopped.append(time.perf_counter() - start)
            saves.wait()
            written.append(time.perf_counter() - start)
    times[rank] = [statistics.median(t) for t in (before, stopped, written)] + [megabytes(state)]
    dist.destroy_process_group()


def fsdp_times(folder: str, repeats: int) -> dict:
    """The slowest rank's medians, GPT-2 small sharded over 2 processes."""
    times = mp.Manager().dict()
    mp.spawn(fsdp_rank, (folder, repeats, 29000 + os.getpid() % 500, times), nprocs=2)
    before, stopped, written, size = (max(rank[i] for rank in times.values()) for i in range(4))
    return dict(before=before, stopped=stopped, written=written, size=size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write (default: a temporary folder)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="saves per row (default 3)")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(
        "| state | MB | loop stopped, waiting for the write (before) | loop stopped now | written now |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        for name, make in (
            ("main job: ResNet-18, SGD, EMA", main_job),
            ("GPT-2 small, AdamW, EMA", gpt2_small),
        ):
            state, average = make()
            files = {Path(folder) / "checkpoint.pt": state, Path(folder) / "model_ema.pt": average}
            size = megabytes(state) + megabytes(average)
            row(name, size, measure(files, args.repeats))
        t = fsdp_times(folder, args.repeats)
        row("GPT-2 small, AdamW, EMA, sharded: each of 2 processes", t["size"], t)
    print(
        f"\n{torch.get_num_threads()} threads, PyTorch {torch.__version__}; {args.repeats} saves a row, medians."
    )


if __name__ == "__main__":
    main()
