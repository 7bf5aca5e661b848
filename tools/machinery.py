"""What the scripts' machinery costs a step: rank 0's main-thread CPU time per training step of distributed.py
against the textbook DDP loop fed the same data (the same tensors, batch, model, SGD and schedule), on 1 and on 2
processes. Each run notes time.thread_time() at every training forward (a forward pre-hook on the model), at the
forward's end and around the optimizer's step; a step is the median of the differences after the first 50 steps, so
a record's step or a stray wait does not move it. Both load their batches in one DataLoader worker, so that the main
thread does what the step does, and compute on one thread (OMP_NUM_THREADS=1).

This machine's speed drifts by a third from one run to the next, more than the machinery costs; the forward and the
optimizer's step are the same work in both loops, so the ratio of their times is the ratio of the two runs' speeds,
and the machinery is our step less the textbook's step scaled by it (the last column; the plain difference beside it).

    python tools/machinery.py                            # this repository's distributed.py
    python tools/machinery.py --roots . ../old-checkout  # and another version of it, for a before-and-after

Each round runs the textbook loop and each version once, in turn. It prints a table: per world size and version,
the median step of the textbook loop and of ours, their difference and the machinery at the same speed, medians of
the rounds with their range.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from processes import PYTHON, ROOT, run  # noqa: E402
from projects import copy_with_your_functions  # noqa: E402

# the data, model and loss, alike for both loops; a hook notes the main thread's CPU time at each training forward
COMMON = """
import json
import os
import time

import torch
import torch.nn.functional as F
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from extras import builtin

STAMPS = []  # a step each: [start of its forward, end of it, CPU time in the optimizer's step]


# at each training forward; every 50th writes them all (the scripts end by os._exit: no atexit)
def note_step(module, inputs):
    if module.training:
        STAMPS.append([time.thread_time(), 0.0, 0.0])
        if len(STAMPS) % 50 == 0 and os.environ.get("RANK", "0") == "0":
            with open(os.environ["STAMPS"], "w") as f:
                json.dump(STAMPS, f)


def note_forward_end(module, inputs, outputs):
    if module.training:
        STAMPS[-1][1] = time.thread_time()


# the optimizer's step, alike in both loops: with the forward, the yardstick of this run's speed
def note_optimizer_start(optimizer, args, kwargs):
    STAMPS[-1][2] -= time.thread_time()


def note_optimizer_end(optimizer, args, kwargs):
    STAMPS[-1][2] += time.thread_time()


register_optimizer_step_pre_hook(note_optimizer_start)
register_optimizer_step_post_hook(note_optimizer_end)


def build_datasets(args):
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(int(os.environ["SAMPLES"]), 3, 8, 8, generator=generator)
    labels = torch.randint(0, 10, (len(images),), generator=generator)
    samples = list(zip(images, labels))
    return samples, samples[:64], 10


def build_model(args, num_classes):
    model = builtin.model("tiny", num_classes, 8)
    model.register_forward_pre_hook(note_step)
    model.register_forward_hook(note_forward_end)
    return model


def compute_loss(outputs, targets):
    return F.cross_entropy(outputs, targets)
"""

# the textbook loop: what the tutorials write, with the same pieces
TEXTBOOK = """
import argparse

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

import utils


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--lr", type=float)
    args, _ = parser.parse_known_args()
    dist.init_process_group("gloo")
    world_size = dist.get_world_size()
    torch.manual_seed(0)
    train_set, _, num_classes = build_datasets(args)
    sampler = DistributedSampler(train_set, drop_last=True)
    loader = DataLoader(
        train_set, args.batch_size // world_size, sampler=sampler, drop_last=True, num_workers=1,
        persistent_workers=True, multiprocessing_context="forkserver",
    )
    model = DDP(build_model(args, num_classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    scheduler = utils.warmup_cosine(optimizer, args.epochs * len(loader), 0.1)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for images, labels in loader:
            loss = compute_loss(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""

STEPS = 400  # an epoch's steps on any world size: batch 8, 3200 samples


def per_step(path: Path) -> tuple[float, float]:
    """The median main-thread CPU time of a step, and of its forward and optimizer step (the same
    work in both loops), microseconds, after the first 50 steps."""
    stamps = json.loads(path.read_text())[50:]
    step = statistics.median(b[0] - a[0] for a, b in zip(stamps, stamps[1:]))
    common = statistics.median(end - start + optimizer for start, end, optimizer in stamps[:-1])
    return step * 1e6, common * 1e6


def run_once(script: Path, processes: int, stamps: Path, out: Path) -> tuple[float, float]:
    """One run of script on processes ranks: per_step of it."""
    flags = ["--batch-size", "8", "--epochs", "1", "--lr", "0.05", "--workers", "1"]
    if script.name == "distributed.py":
        flags += ["--print-freq", "100", "--output-dir", str(out)]
    # torchrun for both, on 1 process too (the textbook loop needs its rendezvous)
    command = [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
        script,
        *flags,
    ]
    env = {"STAMPS": str(stamps), "SAMPLES": str(STEPS * 8), "OMP_NUM_THREADS": "1"}
    stamps.unlink(missing_ok=True)  # never an earlier run's
    run(command, timeout=600, cwd=script.parent, env=env)
    return per_step(stamps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--roots",
        type=Path,
        nargs="+",
        default=[ROOT],
        help="the repositories whose distributed.py runs (another version of it: a before-and-after)",
    )
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2], help="world sizes")
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds of the textbook loop, then each version"
    )
    args = parser.parse_args()
    print(f"tiny model, 8x8 images, batch 8, {STEPS} steps; median of {args.repeats} rounds")
    print(
        "| processes | distributed.py of | textbook loop, us/step | ours, us/step | difference, us/step"
        " | machinery at the same speed, us/step |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        scripts = []
        for k, root in enumerate(args.roots):
            scripts.append(
                copy_with_your_functions("distributed.py", Path(tmp) / str(k), COMMON, root=root)
            )
        textbook = Path(tmp) / "0" / "textbook.py"
        textbook.write_text(COMMON + TEXTBOOK)
        for processes in args.processes:
            # each round runs every program once, in turn: a machine whose speed drifts moves all alike
            rounds = [
                [
                    run_once(
                        script,
                        processes,
                        Path(tmp) / f"{k}.json",
                        Path(tmp) / f"out{k}-{processes}-{r}",
                    )
                    for k, script in enumerate([textbook, *scripts])
                ]
                for r in range(args.repeats)
            ]
            for k, root in enumerate(args.roots, 1):
                raw = [steps[k][0] - steps[0][0] for steps in rounds]
                # the textbook's step at this run's speed (the ratio of the common work's times),
                # which drifts from run to run on a shared machine
                extra = [steps[k][0] - steps[0][0] * steps[k][1] / steps[0][1] for steps in rounds]
                print(
                    f"| {processes} | {root.resolve().name} | "
                    f"{statistics.median(steps[0][0] for steps in rounds):.0f} | "
                    f"{statistics.median(steps[k][0] for steps in rounds):.0f} | "
                    f"{statistics.median(raw):+.0f} ({min(raw):+.0f} to {max(raw):+.0f}) | "
                    f"{statistics.median(extra):+.0f} ({min(extra):+.0f} to {max(extra):+.0f}) |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
