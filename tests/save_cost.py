"""What a checkpoint save costs the training loop: the seconds the loop is stopped and the seconds the write takes,
written the way the scripts wrote it before (utils.checkpoints.save_checkpoint: the loop waits for the last byte) and
the way they write it now (utils.checkpoints.Saves: a copy in host memory, written by a thread while training goes
on), for the state the DDP scripts save: the weights, the optimizer's state and the moving average.

    python tests/save_cost.py                  # the main job's ResNet-18 (SGD) and GPT-2 small (AdamW)
    python tests/save_cost.py --dir /scratch   # on another disk

Each row is the median of --repeats saves into --dir (the first makes the host copies, the others reuse them, as a
run's saves do), each file fsync'ed as the scripts do.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
import torch  # noqa: E402
import torchvision  # noqa: E402

from utils import checkpoints  # noqa: E402


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
    seen, total = set(), 0
    for leaf in torch.utils._pytree.tree_flatten(state)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.data_ptr() not in seen:
            seen.add(leaf.data_ptr())
            total += leaf.numel() * leaf.element_size()
    return total / 2**20


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
            t = measure(files, args.repeats)
            print(
                f"| {name} | {size:,.0f} | {t['before']:.2f} s | {t['stopped']:.3f} s "
                f"({t['stopped'] / t['before']:.2f}x) | {t['written']:.2f} s |"
            )
    print(
        f"\n{torch.get_num_threads()} threads, PyTorch {torch.__version__}; {args.repeats} saves a row, medians."
    )


if __name__ == "__main__":
    main()
