"""Where the time goes. With --phases (off by default: they observe), each record's phases a step on every rank,
and the rank slower than the others in its own work named with its phase; MFU in each epoch's line: the achieved
TFLOP/s over the dense peak of the run's GPUs at its precision, from a table matched on the GPU's name, or
--peak-tflops; a GPU the table does not hold writes no mfu and the start says why, once, a CPU mfu null (no peak to
know). --profile A:B: a torch.profiler trace of those steps a rank, the step's phases
marked in it; without it, nothing."""

from __future__ import annotations

import pytest
import torch

import json
import re
import subprocess
from pathlib import Path

from processes import (
    PYTHON,
    TINY,
    ends_every_rank_with,
    metrics,
    run,
    run_parallel,
    steps,
    torchrun,
)
from projects import copy_with_your_functions
from test_your_own_data import start_up_step
from extras import peaks, profiles

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


def test_a_float32_peak_follows_the_precision_its_matmuls_and_convolutions_run_in(monkeypatch):
    """On a stubbed H100, float32: a model of matmuls alone is rated against the full float32 peak (67 TFLOP/s)
    under PyTorch's default matmul precision ("highest"), against TF32's (494.5) with "high"; one of convolutions
    against TF32's (cuDNN's default); a model of both, each part at its own peak; bfloat16 as the table gives it."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda")
    # PyTorch's switches set and put back by hand: cuBLAS's comes from its module's __getattr__, which
    # pytest 9.2's monkeypatch takes for no value and deletes on undo
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    previous = matmul.allow_tf32, cudnn.allow_tf32, torch.get_float32_matmul_precision()
    try:
        matmul.allow_tf32, cudnn.allow_tf32 = False, True
        assert peaks.peak_tflops(cuda, torch.float32, None, 1, 0.0) == 67.0
        assert peaks.peak_tflops(cuda, torch.float32, None, 1, 1.0) == 494.5
        assert peaks.peak_tflops(cuda, torch.float32, None, 2, 0.9) == pytest.approx(
            2 / (0.9 / 494.5 + 0.1 / 67)
        )
        assert peaks.peak_tflops(cuda, torch.bfloat16, None, 1, 0.9) == 989.5
        torch.set_float32_matmul_precision("high")
        assert peaks.peak_tflops(cuda, torch.float32, None, 1, 0.0) == 494.5
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = previous[:2]
        torch.set_float32_matmul_precision(previous[2])


def test_a_causal_language_models_start_up_flops_are_the_fields_count():
    """GPT-2 built from its config (4 layers, width 256, 128 tokens a sample): the start-up step's FLOPs a sample are
    the count nanoGPT and the PaLM paper make, 6N a token (N the parameters but the position embeddings; the head,
    tied to the token embeddings, counted as the matmul it is) plus attention's 12 L T d, within 1 % (10 % the
    bound); Hugging Face's Conv1D layers are matmuls: no convolutions."""
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, width, length, vocabulary = 4, 256, 128, 1000
    config = GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=4,
        n_positions=length,
        vocab_size=vocabulary,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    tokens = torch.randint(0, vocabulary, (4, length), generator=torch.Generator().manual_seed(0))

    def next_tokens(outputs, targets):
        return torch.nn.functional.cross_entropy(outputs.logits.flatten(0, 1), targets.flatten())

    flops, convolutions = start_up_step(model, tokens, tokens, next_tokens)
    parameters = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
    counted = length * (6 * parameters + 12 * layers * length * width)
    assert flops == pytest.approx(counted, rel=0.01) and convolutions == 0


def test_a_cpu_run_writes_mfu_null_and_no_phases_and_a_given_peak_gives_one(tmp_path):
    """2 processes on the CPU: TFLOP/s and mfu null in metrics.jsonl, no line of it, and without --phases no phase
    in any record; with --peak-tflops, each epoch's mfu is its TFLOP/s over both processes' peak."""
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
    assert "mfu" not in unknown.stdout, unknown.stdout
    assert all(m["mfu"] is None and m["tflops"] > 0 for m in metrics(tmp_path / "unknown"))
    records = [*steps(tmp_path / "unknown"), *metrics(tmp_path / "unknown")]
    assert records and not [r for r in records if "phase_ms" in r or "slow" in r]
    assert not (tmp_path / "unknown" / "profile").exists()  # no --profile: no trace
    assert given.stdout.splitlines().count("mfu over 2 x 0.002 TFLOP/s (--peak-tflops)") == 1
    epochs = metrics(tmp_path / "given")
    assert len(epochs) == 2
    for m in epochs:
        assert m["tflops"] > 0 and m["mfu"] == pytest.approx(m["tflops"] / (2 * 0.002), rel=1e-9)


PHASES = ["data", "forward + loss", "backward", "wait", "optimizer"]

# rank 1 pauses 30 ms a step where SLOW_IN says: in the user's collate, compute_loss, a gradient hook of the
# model's first layer (whose gradient the backward reaches last) or an optimizer step hook; or, a hiccup, 200 ms in
# its 20th backward alone
SLOW_RANK = """
import itertools
import os
import time

import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import default_collate

from extras import builtin

SLOW_IN = os.environ.get("SLOW_IN") if os.environ.get("RANK") == "1" else None


BACKWARDS = itertools.count(1)


def pause(where):
    if SLOW_IN == where:
        time.sleep(0.03)
    if SLOW_IN == "hiccup" and where == "backward" and next(BACKWARDS) == 20:
        time.sleep(0.2)


def build_datasets(args):
    return builtin.datasets(args)


def build_model(args, num_classes):
    model = builtin.model(args.arch, num_classes, args.image_size)
    next(model.parameters()).register_hook(lambda grad: pause("backward"))
    register_optimizer_step_post_hook(lambda *_: pause("optimizer"))
    return model


def compute_loss(outputs, targets):
    pause("compute_loss")
    return F.cross_entropy(outputs, targets)


def collate(samples):
    pause("collate")
    return default_collate(samples)
"""
# where rank 1 pauses, and the phase its records must name
SLOW = {
    "collate": "data",
    "compute_loss": "forward + loss",
    "backward": "backward",
    "optimizer": "optimizer",
}


def slow_copy(base: Path) -> Path:
    """distributed.py with SLOW_RANK's functions, copied into base/copy."""
    return copy_with_your_functions("distributed.py", base / "copy", SLOW_RANK)


FLAGS = [*TINY, "--epochs", "1", "--print-freq", "16", "--no-augment", "--phases"]


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory) -> dict:
    """distributed.py on 2 processes with rank 1 slow in each place: (stdout, records, epochs). They run at once:
    each sleeps most of its steps."""
    base = tmp_path_factory.mktemp("slow")
    copy = slow_copy(base)
    results = run_parallel(
        [
            (torchrun(2, copy, *FLAGS, "--output-dir", base / case), {"SLOW_IN": case})
            for case in SLOW
        ],
        timeout=300,
        at_once=len(SLOW),
    )
    return {
        case: (result.stdout, steps(base / case), metrics(base / case), base / case)
        for case, result in zip(SLOW, results)
    }


@pytest.mark.alone  # its runs, made for its first case: a neighbour's load (CI) once hid rank 1's 30 ms in its step
@pytest.mark.parametrize("where", SLOW)
def test_a_slow_rank_is_named_with_its_phase_in_each_record_and_the_epochs_line(where, slow_runs):
    """Rank 1 paused 30 ms a step in its data, forward, backward or optimizer step: each record and the epoch's line
    name it, with that phase, against the other rank's time there; the other rank's wait is not its own work."""
    stdout, records, epochs, _ = slow_runs[where]
    trained = [r for r in records if "phase_ms" in r]
    assert len(trained) == 2 and len(epochs) == 1
    for record in [*trained, *epochs]:
        slow = record["slow"]
        assert slow is not None and (slow["rank"], slow["phase"]) == (1, SLOW[where]), record
        assert slow["ms"] == record["phase_ms"][SLOW[where]][1] > 25
        assert slow["median_ms"] == record["phase_ms"][SLOW[where]][0]
    line = next(line for line in stdout.splitlines() if line.startswith("epoch 1/1 train_loss"))
    assert re.search(
        rf"; rank 1 slow: {re.escape(SLOW[where])} \d+\.\d ms a step against a median of \d+\.\d ms$",
        line,
    ), line


@pytest.mark.alone  # a neighbour's load would slow one rank's phases
def test_an_even_run_with_a_hiccup_names_no_rank_and_its_phases_add_up_to_its_steps(tmp_path):
    """Rank 1 even but for one hiccup of 200 ms in one backward (step 20: 12.5 ms a step on average over its record,
    6.3 over the epoch, which named it when an average alone counted): no rank is named, in any record or the epoch's
    line; each record's phases, on each rank, add up to its steps' time (the global batch over its images/s), within
    5% (or 1 ms) a step."""
    stdout = run(
        torchrun(2, slow_copy(tmp_path), *FLAGS, "--output-dir", tmp_path / "even"),
        env={"SLOW_IN": "hiccup"},
    ).stdout
    records, epochs = steps(tmp_path / "even"), metrics(tmp_path / "even")
    trained = [r for r in records if "phase_ms" in r]
    assert len(trained) == 2 and all(r["slow"] is None for r in [*trained, *epochs])
    assert " slow: " not in stdout
    for record in trained[1:]:  # the first holds the first steps' warm-up
        step_ms = 1000 * 32 / record["images_per_s"]
        for rank in (0, 1):
            total = sum(times[rank] for times in record["phase_ms"].values())
            assert abs(total - step_ms) < max(1.0, 0.05 * step_ms), (rank, total, step_ms, record)
        assert list(record["phase_ms"]) == PHASES


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


def test_a_profile_of_steps_the_run_never_reaches_says_so(tmp_path, caplog):
    """--profile 5:6 on a run of 2 steps: no trace, and one line says why, where it had ended in silence."""
    phases = profiles.StepPhases(torch.device("cpu"))
    with caplog.at_level("INFO", logger="train"):
        with profiles.StepProfiler("5:6", phases, tmp_path, rank=0):
            for _ in range(2):  # a step's phases, as the hooks enter them
                for phase in (
                    profiles.DATA,
                    profiles.FORWARD,
                    profiles.BACKWARD,
                    profiles.OPTIMIZER,
                ):
                    phases.watchers[0](phase)
            phases.watchers[0](None)
    assert not (tmp_path / "profile").exists()
    assert caplog.messages == [
        "--profile 5:6: no trace written: this run ended after 2 optimizer steps, before step 5"
    ]


def test_the_phases_are_drawn_a_bar_a_rank_in_the_runs_picture(slow_runs, tmp_path):
    """The run's curves.svg ends with the last training record's phases, a stacked bar a rank, a rectangle a phase
    as wide as its time, the slow rank named; tools/plot_records.py --phases draws the epoch line's alike."""
    import xml.etree.ElementTree as ET

    from extras.curves import LEFT, WIDTH

    _, records, epochs, out = slow_runs["compute_loss"]
    run(
        [
            PYTHON,
            "tools/plot_records.py",
            out / "metrics.jsonl",
            "--phases",
            "--out",
            tmp_path / "p.svg",
        ]
    )
    for path, record in (
        (out / "curves.svg", [r for r in records if "phase_ms" in r][-1]),
        (tmp_path / "p.svg", epochs[-1]),
    ):
        root = ET.parse(path).getroot()
        bars = [
            rect for rect in root.iter("{http://www.w3.org/2000/svg}rect") if rect.get("data-rank")
        ]
        assert [(int(r.get("data-rank")), r.get("data-phase")) for r in bars] == [
            (rank, name) for rank in (0, 1) for name in PHASES
        ]
        widths = [float(rect.get("width")) for rect in bars]
        times = [record["phase_ms"][name][rank] for rank in (0, 1) for name in PHASES]
        longest = max(sum(times[:5]), sum(times[5:]))
        assert widths == pytest.approx(
            [t * (WIDTH - LEFT - 20) / longest for t in times], abs=0.006
        )
        assert "rank 1 slow: forward + loss" in ET.tostring(root, encoding="unicode")


@pytest.mark.alone  # the busy process is the load; a neighbour's test on top named rank 0 in CI (7.1 ms against 1.4)
def test_a_tiny_run_beside_a_busy_process_names_no_slow_rank(tmp_path):
    """The tiny model's steps take a few milliseconds: beside a process that works in bursts (8 ms of every 20, a
    machine doing other work), a scheduler's hiccup (once 3.0 ms of backward against a median of 0.3 ms) is no slow
    rank. Three runs; no record of 16 steps, epoch's line or record names one. (A process that keeps a core busy for
    the whole run, on 2 cores, halves the speed of the rank whose core it shares for the run's 70 ms of steps: that
    rank is slower, and was named, e.g. 8.1 ms of backward a step against 2.3, in 4 of 9 tries here.)"""
    bursts = "import time\nend = time.time() + 120\nwhile time.time() < end:\n    t = time.time() + 0.008\n    while time.time() < t:\n        pass\n    time.sleep(0.012)"
    busy = subprocess.Popen([PYTHON, "-c", bursts], start_new_session=True)
    try:
        results = [
            run(
                torchrun(
                    2,
                    "distributed.py",
                    *TINY,
                    "--epochs",
                    "1",
                    "--print-freq",
                    "16",
                    "--phases",
                    "--output-dir",
                    tmp_path / str(i),
                )
            )
            for i in range(3)
        ]
    finally:
        busy.kill()
        busy.wait(timeout=30)
    for i, result in enumerate(results):
        records = [*steps(tmp_path / str(i)), *metrics(tmp_path / str(i))]
        assert [r for r in records if r.get("slow")] == [] and " slow: " not in result.stdout, (
            result.stdout
        )


# the model sleeps SLEEP_IN_EVAL seconds in each evaluation forward
SLOW_VALIDATION = """
import os
import time

from extras import builtin


class SlowToValidate(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        if not self.training:
            time.sleep(float(os.environ["SLEEP_IN_EVAL"]))
        return self.model(x)


def build_datasets(args):
    return builtin.datasets(args)


def build_model(args, num_classes):
    return SlowToValidate(builtin.model(args.arch, num_classes, args.image_size))


def compute_loss(outputs, targets):
    return F.cross_entropy(outputs, targets)
"""


def test_a_slow_validation_mid_epoch_leaves_the_training_speed_and_its_phases_as_they_are(tmp_path):
    """--eval-every 4 with a model that sleeps 100 ms in each evaluation forward: 7 validations mid-epoch, each of 4
    batches a rank (and the moving average's as many): the epoch's images/s are its training steps', at least 2.8 s
    (the sleeps of the model's validations alone) shorter than its epoch_time_s; no phase holds a validation (the
    optimizer's, where it ran, under 50 ms a step in each record, against about 200 were it counted). Not timed
    against another run: the sleeps are the bound."""
    copy = copy_with_your_functions("distributed.py", tmp_path / "copy", SLOW_VALIDATION)
    flags = [
        *TINY,
        "--epochs",
        "1",
        "--print-freq",
        "8",
        "--eval-every",
        "4",
        "--no-augment",
        "--phases",
    ]
    run(
        torchrun(2, copy, *flags, "--output-dir", tmp_path / "slow"),
        env={"SLEEP_IN_EVAL": "0.1"},
        timeout=300,
    )
    trained = [r for r in steps(tmp_path / "slow") if "phase_ms" in r]
    validated = [r for r in steps(tmp_path / "slow") if "val_loss" in r]
    assert len(trained) == 4 and len(validated) == 8, (trained, validated)
    for record in trained:
        assert max(record["phase_ms"]["optimizer"]) < 50, record
    (epoch,) = metrics(tmp_path / "slow")
    assert epoch["epoch_time_s"] - 32 * 32 / epoch["images_per_s"] >= 7 * 4 * 0.1, epoch
