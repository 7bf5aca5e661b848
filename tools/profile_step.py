"""Where a training step's time goes, without the input pipeline: one batch that
stays on the device, the scripts' model and step, timed with CUDA events, then
the profiler's busiest operations. Compare its images/s with the benchmark's to
see what the data loader and the rest of the script cost.

    python tools/profile_step.py --arch resnet18 --amp-dtype bfloat16 --channels-last
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from extras import builtin  # noqa: E402
import utils  # noqa: E402
from processes import free_port  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="resnet18", help="model, as the scripts' --arch")
    p.add_argument("--image-size", type=int, default=32, help="image height and width")
    p.add_argument("--batch-size", type=int, default=512, help="images per step")
    p.add_argument(
        "--amp-dtype",
        choices=["float16", "bfloat16"],
        default=None,
        help="autocast dtype (default: fp32)",
    )
    p.add_argument("--channels-last", action="store_true", help="NHWC model and input")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--compile-mode", default=None, help="mode, e.g. reduce-overhead (CUDA graphs)")
    p.add_argument(
        "--no-ddp", action="store_true", help="plain module instead of DDP at world size 1"
    )
    p.add_argument(
        "--broadcast-buffers", action="store_true", help="DDP's per-forward buffer broadcast on"
    )
    p.add_argument(
        "--steps", type=int, default=50, help="timed steps (after as many warm-up steps)"
    )
    p.add_argument("--top", type=int, default=15, help="rows of the profiler table")
    return p.parse_args()


def build(args, device: torch.device) -> torch.nn.Module:
    model = builtin.model(args.arch, 10, args.image_size)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = model.to(device)
    if not args.no_ddp:
        buffers = {} if args.broadcast_buffers else utils.no_buffer_sync_per_forward()
        model = DDP(model, device_ids=[device.index], gradient_as_bucket_view=True, **buffers)
    return (
        torch.compile(model, mode=args.compile_mode) if args.compile or args.compile_mode else model
    )


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: profile_step.py times CUDA events: it needs a GPU, and none is visible")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.backends.cudnn.benchmark = True
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    model = build(args, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    images = torch.randint(
        0,
        256,
        (args.batch_size, 3, args.image_size, args.image_size),
        dtype=torch.uint8,
        device=device,
    )
    targets = torch.randint(0, 10, (args.batch_size,), device=device)
    dtype = getattr(torch, args.amp_dtype) if args.amp_dtype else None
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)

    finish = builtin.ImageBatchTransform(
        seed=0, padding=args.image_size // 8
    )  # crop, flip, normalise

    def step() -> None:
        x = finish(images, key=(0, 0))
        if args.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast("cuda", dtype=dtype) if dtype else nullcontext():
            loss = F.cross_entropy(model(x), targets)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    for _ in range(args.steps):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.steps):
        step()
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end) / args.steps
    print(
        f"{ms:.2f} ms per step, {args.batch_size / ms * 1000:.0f} images/s, "
        f"{torch.cuda.get_device_name(device)}, {vars(args)}"
    )
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(
        prof.key_averages().table(
            sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=60
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
