"""What starting DataLoader workers from a forkserver costs, against a fork of the rank's process: seconds from
iter() to the first batch (the workers' start), and each worker's own memory (USS: pages no other process shares)
and its proportional share (PSS), for the built-in in-memory images (--dataset fake), 2 workers.

    python tools/worker_start.py --fake-size 50000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import utils  # noqa: E402
from extras import builtin, workers  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402


def memory_mb(pid: int) -> tuple[float, float]:
    """(USS, PSS) of a process in MB, from /proc/PID/smaps_rollup."""
    fields = dict(
        line.split(":") for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]
    )
    kb = lambda key: int(fields[key].split()[0])  # noqa: E731
    return (kb("Private_Clean") + kb("Private_Dirty")) / 1024, kb("Pss") / 1024


def measure(context, dataset, processes: int) -> dict:
    loader = DataLoader(
        dataset,
        256,
        shuffle=True,
        num_workers=processes,
        persistent_workers=True,
        worker_init_fn=workers.init_worker,
        multiprocessing_context=context,
        collate_fn=utils.Counted(torch.utils.data.default_collate),
    )
    started = time.perf_counter()
    loaded = iter(loader)
    next(loaded)
    first = time.perf_counter() - started
    # every worker has touched its share of the images by now
    for _ in range(min(20, len(loader) - 1)):
        next(loaded)
    memory = [memory_mb(w.pid) for w in loaded._workers]
    return dict(
        first_batch_s=first, uss_mb=max(m[0] for m in memory), pss_mb=max(m[1] for m in memory)
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fake-size", type=int, default=50_000, help="images of --dataset fake")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    args = parser.parse_args()
    dataset = builtin.fake_images(args.fake_size, 32, "train")
    sys.modules["__main__"].__file__ = str(
        Path(workers.__file__).parents[1] / "distributed.py"
    )  # preload as it does
    print(
        f"--dataset fake, {args.fake_size} images ({dataset.tensors[0].numel() / 2**20:.0f} MB), "
        f"{args.workers} workers"
    )
    for name, context in (
        ("fork", "fork"),
        ("forkserver (the scripts')", workers.worker_start(args.workers)),
    ):
        print(
            f"{name:28s}"
            + "  ".join(f"{k} {v:7.2f}" for k, v in measure(context, dataset, args.workers).items())
        )


if __name__ == "__main__":
    main()
