"""Where the time goes. MFU in each epoch's line: the achieved TFLOP/s over the dense peak of the run's GPUs at its
precision, from a table matched on the GPU's name, or --peak-tflops; a CPU, or a GPU the table does not hold, writes
no mfu and the start says why, once. --profile A:B: a torch.profiler trace of those steps a rank, the step's phases
marked in it; without it, nothing."""

from __future__ import annotations

import pytest
import torch

import json

from processes import TINY, ends_every_rank_with, metrics, run, run_parallel, torchrun
from utils import peaks

# (torch.cuda.get_device_name(), bfloat16, float16, float32 with TF32, float32 without) as NVIDIA's data sheets give
# them, dense
NAMES = [
    ("NVIDIA H100 80GB HBM3", 989.5, 989.5, 494.5, 67.0),
    ("NVIDIA H100 PCIe", 756.5, 756.5, 378.0, 51.0),
    ("NVIDIA H100 NVL", 835.5, 835.5, 417.5, 60.0),
    ("NVIDIA H200", 989.5, 989.5, 494.5, 67.0),
    ("NVIDIA H200 NVL", 835.5, 835.5, 417.5, 60.0),
    ("NVIDIA A100-SXM4-80GB", 312.0, 312.0, 156.0, 19.5),
    ("NVIDIA A100-PCIE-40GB", 312.0, 312.0, 156.0, 19.5),
    ("Tesla V100-SXM2-16GB", None, 125.0, 15.7, 15.7),  # no bfloat16 or TF32 tensor cores
    ("NVIDIA A10G", None, None, None, None),  # not the A10 of the table
    ("NVIDIA GeForce RTX 4090", None, None, None, None),
    ("an accelerator nobody knows", None, None, None, None),
]


@pytest.mark.parametrize("name, bf16, fp16, tf32, fp32", NAMES)
def test_the_table_gives_each_gpu_its_dense_peak_and_an_unknown_one_none(
    name, bf16, fp16, tf32, fp32
):
    assert peaks.known_peak(name, torch.bfloat16, True) == bf16
    assert peaks.known_peak(name, torch.float16, True) == fp16
    assert peaks.known_peak(name, torch.float32, True) == tf32
    assert peaks.known_peak(name, torch.float32, False) == fp32


def test_a_cpu_run_writes_no_mfu_and_says_why_once_and_a_given_peak_gives_one(tmp_path):
    """2 processes on the CPU: no mfu in metrics.jsonl, and one line saying why; with --peak-tflops, each epoch's
    mfu is its TFLOP/s over both processes' peak."""
    flags = [*TINY, "--epochs", "2", "--no-augment"]
    unknown, given = run_parallel(
        [
            (torchrun(2, "distributed.py", *flags, "--output-dir", tmp_path / "unknown"), {}),
            (
                torchrun(
                    2,
                    "distributed.py",
                    *flags,
                    "--peak-tflops",
                    "0.002",
                    "--output-dir",
                    tmp_path / "given",
                ),
                {},
            ),
        ]
    )
    why = "no mfu: no known peak TFLOP/s for cpu (give one with --peak-tflops)"
    assert unknown.stdout.splitlines().count(why) == 1, unknown.stdout
    assert "mfu" not in unknown.stdout.replace(why, "")
    assert all("mfu" not in m and m["tflops"] > 0 for m in metrics(tmp_path / "unknown"))
    assert not (tmp_path / "unknown" / "profile").exists()  # no --profile: no trace
    assert given.stdout.splitlines().count("mfu over 2 x 0.002 TFLOP/s (--peak-tflops)") == 1
    epochs = metrics(tmp_path / "given")
    assert len(epochs) == 2
    for m in epochs:
        assert m["tflops"] > 0 and m["mfu"] == pytest.approx(m["tflops"] / (2 * 0.002), rel=1e-9)


PHASES = ["data", "forward", "loss + backward", "optimizer"]


def test_profile_writes_a_trace_a_rank_with_each_steps_phases(tmp_path):
    """--profile 3:5 on 2 processes: profile/rank0.json and rank1.json, each a Chrome trace (JSON) holding the
    phases of steps 3, 4 and 5 as ranges, 3 of each, in order; one line says where they are. A --profile that names
    no steps, or a peak that is not positive, ends every rank with one line."""
    result = run(
        torchrun(
            2,
            "distributed.py",
            *TINY,
            "--epochs",
            "1",
            "--profile",
            "3:5",
            "--output-dir",
            tmp_path / "out",
        )
    )
    lines = [
        line for line in result.stdout.splitlines() if line.startswith("profile of steps 3-5: ")
    ]
    assert lines == [
        f"profile of steps 3-5: {tmp_path / 'out' / 'profile'}/rank*.json, one a rank (open in "
        "https://ui.perfetto.dev, or with Holistic Trace Analysis)"
    ], result.stdout
    assert sorted(p.name for p in (tmp_path / "out" / "profile").iterdir()) == [
        "rank0.json",
        "rank1.json",
    ]
    for rank in (0, 1):
        events = json.loads((tmp_path / "out" / "profile" / f"rank{rank}.json").read_text())[
            "traceEvents"
        ]
        ranges = sorted(
            (e["ts"], e["name"]) for e in events if e.get("ph") == "X" and e["name"] in PHASES
        )
        assert [name for _, name in ranges] == PHASES * 3, ranges
    wrong_steps, wrong_peak = run_parallel(
        [
            (
                torchrun(
                    2, "distributed.py", *TINY, "--profile", "5:3", "--output-dir", tmp_path / "a"
                ),
                {},
            ),
            (
                torchrun(
                    2, "distributed.py", *TINY, "--peak-tflops", "0", "--output-dir", tmp_path / "b"
                ),
                {},
            ),
        ],
        check=False,
    )
    ends_every_rank_with(
        wrong_steps, "error: --profile 5:3: give the first and last step as A:B, 1 <= A <= B"
    )
    ends_every_rank_with(
        wrong_peak, "error: --timeout, --clip-grad, --save-minutes and --peak-tflops must be > 0"
    )
