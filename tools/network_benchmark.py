"""Two hosts over a rate-limited link: DDP in float32, DDP with --comm-hook bf16, and DiLoCo with H = 8 and 32, at
each rate, one process per host, the README's main job (ResNet-18). The hosts are network namespaces joined by a veth
pair whose rate `tc` limits on both ends (tbf), as tests/test_multinode.py builds them; this needs root. Prints a
table (images/s, MB each process sends a step, validation accuracy after the same samples) and writes a chart.

    python tools/network_benchmark.py --chart docs/network.svg
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmark import Case, chart, hardware
from processes import (
    README_JOB,
    ROOT,
    can_make_hosts,
    free_port,
    metrics,
    on_host,
    run_parallel,
    steps,
    two_hosts,
)

JOB = [
    *README_JOB,
    "--print-freq",
    "4",
    "--timeout",
    "600",
]
CASES = [
    ("DDP float32", "distributed.py", []),
    ("DDP --comm-hook bf16", "distributed.py", ["--comm-hook", "bf16"]),
    # at the outer optimizer's defaults
    ("DiLoCo H=8", "distributed_diloco.py", ["--inner-steps", "8"]),
    ("DiLoCo H=32", "distributed_diloco.py", ["--inner-steps", "32"]),
]


def limit(hosts, rate: str) -> None:
    for namespace, _, interface in hosts:  # both directions
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                namespace,
                "tc",
                "qdisc",
                "replace",
                "dev",
                interface,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "256kb",
                "latency",
                "50ms",
            ],
            check=True,
            capture_output=True,
        )


def sent_mb_per_step(out: Path, script: str, flags: list[str]) -> float:
    """What each process sends a step: DiLoCo's records count it; DDP's ring all-reduce sends the gradients' bytes
    (W = 2: 2 (W - 1) / W = 1 times them), half of them in bfloat16."""
    if script == "distributed_diloco.py":
        return statistics.mean(r["sent_mb_per_step"] for r in steps(out) if "sent_mb_per_step" in r)
    weights = torch.load(out / "checkpoint.pt", weights_only=True)["model"]
    params = sum(
        t.numel() * t.element_size()
        for name, t in weights.items()
        if t.is_floating_point() and "running" not in name
    )
    return params / 1e6 / (2 if "bf16" in flags else 1)


def run_case(hosts, script: str, flags: list[str], epochs: int, out: Path) -> dict:
    port, master = free_port(), hosts[0][1]
    run_parallel(
        [
            on_host(
                host,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node_rank={i}",
                "--nproc_per_node=1",
                f"--master_addr={master}",
                f"--master_port={port}",
                script,
                *JOB,
                "--epochs",
                str(epochs),
                *flags,
                "--output-dir",
                out,
            )
            for i, host in enumerate(hosts)
        ],
        timeout=1800,
        cwd=ROOT,
    )
    epochs_run = metrics(out)
    return dict(
        images_per_s=statistics.median(m["images_per_s"] for m in epochs_run[1:]),
        seconds=statistics.median(m["epoch_time_s"] for m in epochs_run[1:]),
        sent=sent_mb_per_step(out, script, flags),
        val_acc=epochs_run[-1]["val_acc"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rates", nargs="+", default=["1gbit", "100mbit"], help="link rates, as tc writes them"
    )
    parser.add_argument(
        "--epochs", type=int, default=3, help="epochs of 16 steps; the first is warm-up"
    )
    parser.add_argument(
        "--chart", type=Path, help="also write images/s of each case and rate as an SVG"
    )
    args = parser.parse_args()
    if not can_make_hosts():
        sys.exit(
            "skipped: two hosts need network namespaces, which need root and iproute2 (ip, tc)"
        )
    rows = []
    with two_hosts() as hosts, tempfile.TemporaryDirectory() as tmp:
        for rate in args.rates:
            limit(hosts, rate)
            for name, script, flags in CASES:
                result = run_case(
                    hosts, script, flags, args.epochs, Path(tmp) / f"{rate}-{len(rows)}"
                )
                rows.append((Case(f"{name}, {rate}", script, 2, flags), result))
                print(json.dumps({"case": rows[-1][0].name, **result}), flush=True)
    print(
        f"\n2 hosts x 1 process over a veth pair limited by tc tbf; the README's main job (ResNet-18, batch 64, "
        f"{args.epochs} epochs of 16 steps, the first warm-up)\n"
    )
    print(
        "| case | images/s | x DDP float32 | s/epoch | MB sent a step, each process | val acc after the same samples |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for i, (case, r) in enumerate(rows):
        ddp = rows[i - i % len(CASES)][1]  # this rate's first row
        print(
            f"| {case.name} | {r['images_per_s']:.0f} | {r['images_per_s'] / ddp['images_per_s']:.1f} | "
            f"{r['seconds']:.1f} | {r['sent']:.1f} | {r['val_acc']:.3f} |"
        )
    print(
        f"\nHardware: {hardware()}.\nCommand: python tools/network_benchmark.py {' '.join(sys.argv[1:])}"
    )
    if args.chart:
        args.chart.write_text(chart(rows, "Two hosts over a rate-limited link: images/s"))


if __name__ == "__main__":
    main()
