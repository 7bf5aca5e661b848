"""Checks of the GPU paths (nccl, DataParallel, AMP float16/bfloat16 with GradScaler, FSDP with CPU offload and
activation checkpointing, SyncBatchNorm, channels_last, torch.compile, CUDA graphs, a stream, a stall, a clean
end, a project's own sampler and metrics, an image folder, and GPU JPEG decoding measured against the CPU's), for a machine with a GPU. CI has none, so
this is run by hand there: `python tools/gpu_check.py`; it prints what it measured, one line per check, and exits
non-zero if a check fails; `--only graphs` (repeatable) runs one group."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

# utils, for the tests' user code; the tests, whose user code and checks this runs on the GPU
sys.path[:0] = [
    str(Path(__file__).resolve().parents[1]),
    str(Path(__file__).resolve().parents[1] / "tests"),
]
from test_host_syncs import PLUGGED  # noqa: E402
from processes import (
    EVAL_EVERY,
    TINY,
    max_weight_difference,
    metrics,
    python,
    run,
    steps,  # noqa: E402
    torchrun,
    weights,
)

failures = []


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        failures.append(name)


EXACT = [
    *TINY,
    "--no-augment",
    *EVAL_EVERY,
]  # the tiny job, each run's weights comparable to the others'


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Checks of the GPU paths: a line each, non-zero exit if one fails"
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=list(SECTIONS),
        help="this group of checks alone (repeatable; default all); the DDP reference runs anyway",
    )
    args = parser.parse_args()
    assert torch.cuda.is_available(), "no GPU visible"
    print(
        f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, PyTorch {torch.__version__}"
    )
    tmp = Path(tempfile.mkdtemp())
    result = run(python("distributed.py", *EXACT, "--tensorboard", "--output-dir", tmp / "ddp"))
    m = metrics(tmp / "ddp")[-1]
    check(
        "distributed.py on cuda (nccl, world 1) learns",
        m["val_acc"] > 0.6,
        f"val_acc {m['val_acc']:.3f}",
    )
    warned = (
        "barrier(): using the device" in result.stderr
    )  # device_id given to init_process_group: no guess
    check("no barrier() device warning", not warned, "warned" if warned else "none printed")
    events = list((tmp / "ddp" / "tensorboard").glob("events.out.tfevents.*"))
    check(
        "--tensorboard on a GPU run wrote its event file",
        len(events) == 1,
        f"{len(events)} event files",
    )
    for name in args.only or SECTIONS:
        SECTIONS[name](tmp)
    print(f"{len(failures)} failed" if failures else "all GPU checks passed")
    sys.exit(1 if failures else 0)


def launchers(tmp: Path) -> None:
    """DataParallel, mp.spawn and accumulation train what distributed.py trains."""
    run(python("dataparallel.py", *EXACT, "--output-dir", tmp / "dp"))
    d = max_weight_difference(tmp / "dp", tmp / "ddp")
    check("dataparallel.py on 1 GPU == distributed.py", d <= 1e-4, f"max weight difference {d:.2e}")
    run(python("distributed_mp.py", *EXACT, "--output-dir", tmp / "mp"))
    d = max_weight_difference(tmp / "mp", tmp / "ddp")
    check(
        "distributed_mp.py (nccl, spawn) == distributed.py",
        d <= 1e-4,
        f"max weight difference {d:.2e}",
    )
    run(
        torchrun(
            1,
            "distributed_grad_accum.py",
            *EXACT,
            "--accum-steps",
            "4",
            "--output-dir",
            tmp / "acc",
        )
    )
    d = max_weight_difference(tmp / "acc", tmp / "ddp")
    check("accumulation K=4 == one batch", d <= 1e-4, f"max weight difference {d:.2e}")


def mixed_precision(tmp: Path) -> None:
    """float16 with GradScaler and bfloat16 learn; an overflow is skipped; a continued run keeps the scaler."""
    for dtype in ("float16", "bfloat16"):
        run(
            torchrun(
                1, "distributed_amp.py", *EXACT, "--amp-dtype", dtype, "--output-dir", tmp / dtype
            )
        )
        m = metrics(tmp / dtype)[-1]
        check(
            f"AMP {dtype} on cuda learns",
            m["val_acc"] > 0.6,
            f"val_acc {m['val_acc']:.3f}, "
            f"loss scale {m['loss_scale']}, skipped {m['skipped_steps']}",
        )
    scaled = [*EXACT, "--amp-dtype", "float16", "--init-scale", str(2.0**40)]
    run(python("distributed_amp.py", *scaled, "--output-dir", tmp / "straight"))
    run(python("distributed_amp.py", *scaled, "--stop-after", "1", "--output-dir", tmp / "resumed"))
    run(python("distributed_amp.py", *scaled, "--output-dir", tmp / "resumed"))
    first = metrics(tmp / "straight")[0]
    finite = all(torch.isfinite(w).all() for w in weights(tmp / "straight").values())
    check(
        "float16 overflow skipped, weights finite",
        first["skipped_steps"] > 0 and finite,
        f"{first['skipped_steps']} skipped steps in epoch 1, scale now {first['loss_scale']}",
    )
    d = max_weight_difference(tmp / "straight", tmp / "resumed")
    same_scale = (
        metrics(tmp / "straight")[-1]["loss_scale"] == metrics(tmp / "resumed")[-1]["loss_scale"]
    )
    check(
        "float16 continued run == uninterrupted (scaler state too)",
        d <= 1e-4 and same_scale,
        f"max weight difference {d:.2e}, same loss scale {same_scale}",
    )


def fully_sharded(tmp: Path) -> None:
    """FSDP over nccl trains what DDP trains, in float32, bfloat16, and with offload and recomputation."""
    run(torchrun(1, "distributed_fsdp.py", *EXACT, "--output-dir", tmp / "fsdp"))
    d = max_weight_difference(tmp / "fsdp", tmp / "ddp")
    check(
        "distributed_fsdp.py (nccl, fp32) == distributed.py",
        d <= 1e-4,
        f"max weight difference {d:.2e}",
    )
    fsdp, ddp = steps(tmp / "fsdp"), steps(tmp / "ddp")
    d = max(
        abs(a[k] - b[k])
        for a, b in zip(fsdp, ddp)
        for k in ("train_loss", "val_loss", "grad_norm")
        if k in a
    )
    same = [r["global_step"] for r in fsdp] == [r["global_step"] for r in ddp]
    check(
        "FSDP's records (losses, the norm over nccl shards) == DDP's",
        same and d <= 1e-4,
        f"max difference {d:.2e}",
    )
    # the sharded checkpoint written in the background (shards copied to pinned host memory, dcp.save in a thread
    # over a gloo group beside nccl), read back by the same command
    continued = ["--stop-after", "1", "--output-dir", tmp / "fsdp-continued"]
    run(torchrun(1, "distributed_fsdp.py", *EXACT, *continued))
    run(torchrun(1, "distributed_fsdp.py", *EXACT, *continued[2:]))
    d = max_weight_difference(tmp / "fsdp-continued", tmp / "fsdp")
    check(
        "FSDP continued from its background-written checkpoint == straight",
        d <= 1e-6,
        f"max weight difference {d:.2e}",
    )
    run(
        torchrun(
            1,
            "distributed_fsdp.py",
            *EXACT,
            "--clip-grad",
            "1",
            "--output-dir",
            tmp / "fsdp-clipped",
        )
    )
    run(
        torchrun(
            1,
            "distributed_fsdp.py",
            *EXACT,
            "--amp-dtype",
            "bfloat16",
            "--output-dir",
            tmp / "fsdp-bf16",
        )
    )
    m = metrics(tmp / "fsdp-bf16")[-1]
    check(
        "FSDP bfloat16 (MixedPrecisionPolicy) learns",
        m["val_acc"] > 0.6,
        f"val_acc {m['val_acc']:.3f}, "
        f"model state {m['params_mb'] + m['grads_mb'] + m['optimizer_mb']:.2f} MB per rank",
    )
    # offloaded state (the gradient norm's all-reduce on the CPU group beside nccl) and recomputed activations
    run(
        torchrun(
            1,
            "distributed_fsdp.py",
            *EXACT,
            "--cpu-offload",
            "--activation-checkpointing",
            "--clip-grad",
            "1",
            "--output-dir",
            tmp / "fsdp-offload",
        )
    )
    d = max_weight_difference(tmp / "fsdp-offload", tmp / "fsdp-clipped")
    check(
        "FSDP --cpu-offload --activation-checkpointing --clip-grad == FSDP --clip-grad",
        d <= 1e-4,
        f"max weight difference {d:.2e}",
    )


def resnet(tmp: Path) -> None:
    """SyncBatchNorm, channels_last and torch.compile on a ResNet-18."""
    resnet = [
        "--dataset",
        "fake",
        "--arch",
        "resnet18",
        "--fake-size",
        "2048",
        "--batch-size",
        "128",
        "--epochs",
        "2",
        "--workers",
        "2",
    ]
    run(torchrun(1, "distributed.py", *resnet, "--sync-bn", "--output-dir", tmp / "syncbn"))
    m = metrics(tmp / "syncbn")[-1]
    check(
        "resnet18 with --sync-bn trains",
        math.isfinite(m["train_loss"]),
        f"train_loss {m['train_loss']:.3f}",
    )
    run(
        torchrun(
            1,
            "distributed_amp.py",
            *resnet,
            "--amp-dtype",
            "bfloat16",
            "--channels-last",
            "--compile",
            "--output-dir",
            tmp / "compiled",
        )
    )
    keys = list(weights(tmp / "compiled"))
    clean = not any(k.startswith(("module.", "_orig_mod.")) for k in keys)
    check("channels_last + compile checkpoint has plain keys", clean, f"first key {keys[0]}")


def cuda_graphs(tmp: Path) -> None:
    """--compile-mode reduce-overhead trains what eager trains, and continues exactly (with TORCHINDUCTOR_DETERMINISTIC=1)."""
    graphs = [*EXACT, "--compile-mode", "reduce-overhead"]  # the step replayed as CUDA graphs
    # Inductor picks some kernels by timing them, in each process: a near tie can go either way and change the
    # sums' order (PyTorch #189121); its deterministic mode picks without timing, so two runs compile alike
    exact = {"TORCHINDUCTOR_DETERMINISTIC": "1"}
    run(python("distributed.py", *graphs, "--output-dir", tmp / "graphs"), timeout=900, env=exact)
    keys = list(weights(tmp / "graphs"))
    d = max_weight_difference(tmp / "graphs", tmp / "ddp")
    check(
        "CUDA graphs (reduce-overhead) == eager, plain keys",
        d <= 1e-4 and not keys[0].startswith("_orig_mod."),
        f"max weight difference {d:.2e}, first key {keys[0]}",
    )
    run(
        python(
            "distributed.py", *graphs, "--stop-after", "1", "--output-dir", tmp / "graphs-resumed"
        ),
        timeout=900,
        env=exact,
    )
    run(
        python("distributed.py", *graphs, "--output-dir", tmp / "graphs-resumed"),
        timeout=900,
        env=exact,
    )
    d = max_weight_difference(tmp / "graphs-resumed", tmp / "graphs")
    check(
        "CUDA graphs: continued run == uninterrupted", d <= 1e-6, f"max weight difference {d:.2e}"
    )


def your_task_on_the_gpu(tmp: Path) -> None:
    """A user's task: labels outside the classes end in one line before any CUDA kernel could assert; a
    regression learns with float16 and GradScaler; a run whose float16 loss turns NaN stops with one line."""
    from projects import COMMON, YOUR_CLASSIFICATION, YOUR_REGRESSION, copy_with_your_functions

    bad = YOUR_CLASSIFICATION.replace("Blobs(203, seed=2), 4", "Blobs(203, seed=2), 3")
    copy = copy_with_your_functions("distributed.py", tmp / "labels", bad)
    result = run(
        python(copy, *COMMON, "--output-dir", tmp / "labels-out"), check=False, cwd=tmp / "labels"
    )
    last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
    check(
        "labels outside the classes: one line, no device-side assert",
        last.startswith("error: class labels") and "device-side assert" not in result.stderr,
        last,
    )
    copy = copy_with_your_functions("distributed_amp.py", tmp / "regression", YOUR_REGRESSION)
    run(
        python(copy, *COMMON, "--amp-dtype", "float16", "--output-dir", tmp / "regression-out"),
        cwd=tmp / "regression",
    )
    losses = [m["val_loss"] for m in metrics(tmp / "regression-out")]
    check(
        "a regression learns with float16 + GradScaler",
        losses[-1] < losses[0] / 5,
        f"val_loss {losses}",
    )
    result = run(
        python(
            "distributed_amp.py",
            *TINY,
            "--amp-dtype",
            "float16",
            "--lr",
            "1e6",
            "--output-dir",
            tmp / "diverged",
        ),
        check=False,
    )
    last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
    check(
        "a diverging float16 run stops with one line",
        result.returncode != 0 and last.startswith("error: training diverged"),
        last,
    )


def your_project_on_the_gpu(tmp: Path) -> None:
    """A project's own sampler, metrics and best weights on cuda: a WeightedRandomSampler trains in distributed.py
    what dataparallel.py trains; torchmetrics' macro F1 and AUROC (their states on the GPU) and top-5 equal
    scikit-learn's on the saved weights, in DDP and FSDP; --keep-best val_f1 keeps the weights of the best F1."""
    from sklearn.metrics import f1_score, roc_auc_score
    from projects import copy_with_your_functions
    from test_your_project import MEASURED_BY, SAMPLED, YOUR_IMBALANCED, YOUR_METRICS, predictions

    outs = {}
    for script in ("distributed.py", "dataparallel.py"):
        copy = copy_with_your_functions(script, tmp / f"sampled-{script}", YOUR_IMBALANCED)
        outs[script] = tmp / f"sampled-{script}-out"
        run(python(copy, *SAMPLED, "--output-dir", outs[script]), cwd=copy.parent)
    d = max_weight_difference(outs["distributed.py"], outs["dataparallel.py"])
    check(
        "a WeightedRandomSampler on cuda: distributed.py == dataparallel.py", d <= 1e-4, f"{d:.2e}"
    )
    for script, saved in (("distributed.py", "checkpoint.pt"), ("distributed_fsdp.py", "model.pt")):
        copy = copy_with_your_functions(script, tmp / f"metrics-{script}", YOUR_METRICS)
        out = tmp / f"metrics-{script}-out"
        flags = ["--keep-best", "val_f1", "--output-dir", out]
        run(python(copy, *MEASURED_BY, *flags), cwd=copy.parent)
        last = metrics(out)[-1]
        state = torch.load(out / saved, map_location="cpu", weights_only=True)
        scores, labels = predictions(YOUR_METRICS, state.get("model", state), 203)
        f1 = f1_score(labels, scores.argmax(1), average="macro")
        auroc = roc_auc_score(labels, scores, multi_class="ovr", average="macro")
        best = torch.load(out / "model_best.pt", map_location="cpu", weights_only=True)
        kept, _ = predictions(YOUR_METRICS, best, 203)
        kept_f1 = f1_score(labels, kept.argmax(1), average="macro")
        highest = max(m["val_f1"] for m in metrics(out))
        check(
            f"{script} on cuda: torchmetrics and top-5 as scikit-learn, the best F1's weights kept",
            abs(last["val_f1"] - f1) <= 1e-4
            and abs(last["val_auroc"] - auroc) <= 1e-4
            and 0 < last["val_acc5"] <= 1
            and abs(kept_f1 - highest) <= 1e-4,
            f"val_f1 {last['val_f1']:.6f} ({f1:.6f}), val_auroc {last['val_auroc']:.6f} ({auroc:.6f}),"
            f" model_best.pt's F1 {kept_f1:.6f} of the highest {highest:.6f}",
        )


def a_stream_on_the_gpu(tmp: Path) -> None:
    """A user's stream (no __len__, 20 of the 25 planned steps) with 2 DataLoader workers: DDP, whose per-step flags
    go over a gloo group beside nccl, and FSDP, whose validation agrees over nccl while any rank has a batch, train
    alike, stop each epoch where the stream ends and count each validation sample once."""
    from test_streams import command

    outs = {
        script: tmp / f"stream-{script}" for script in ("distributed.py", "distributed_fsdp.py")
    }
    for script, out in outs.items():
        run(command(script, tmp, out.name, 1, "--workers", "2"), cwd=tmp)
    ends = {
        r["step"] for r in steps(outs["distributed.py"]) if r["epoch"] == 1 and "train_loss" in r
    }
    counted = {r["val_images"] for out in outs.values() for r in steps(out) if "val_images" in r}
    acc = metrics(outs["distributed.py"])[-1]["val_acc"]
    check(
        "a stream trains on cuda, its epoch cut where it ends",
        max(ends) == 20 and counted == {203} and acc > 0.9,
        f"last step of epoch 1: {max(ends)}, validation samples {counted}, val_acc {acc:.3f}",
    )
    d = max_weight_difference(*outs.values())
    check(
        "a stream: distributed_fsdp.py == distributed.py",
        d <= 1e-4,
        f"max weight difference {d:.2e}",
    )


def a_stall_on_the_gpu(tmp: Path) -> None:
    """A rank stuck in compute_loss on nccl (a world of one: NCCL takes no two ranks on one GPU) ends within the bound,
    saying where; its stalls/ folder holds the Flight Recorder's trace, which PyTorch's analyzer reads."""
    from test_stalls import BOUND, TIMEOUT, user_code
    from projects import COMMON, copy_with_your_functions

    copy = copy_with_your_functions(
        "distributed.py", tmp / "stall", user_code("compute_loss").replace('== "1"', '== "0"')
    )
    out, stalled_at = tmp / "stall-out", tmp / "stalled_at"
    result = run(
        torchrun(1, copy, *COMMON, "--timeout", str(TIMEOUT), "--output-dir", out),
        check=False,
        env={"STALL_FILE": str(stalled_at), "STALL_SECONDS": "3600"},
        timeout=300,
    )
    since = time.time() - float(stalled_at.read_text()) if stalled_at.exists() else math.inf
    line = next((text for text in result.stderr.splitlines() if text.startswith("error:")), "")
    named = re.match(
        r"error: rank 0 made no progress for \d+ s at step 3 of epoch 1, in compute_loss \(distributed"
        r"\.py:\d+\); every rank's stacks in ",
        line,
    )
    check(
        "a stalled rank on nccl ends with its line",
        bool(named) and since <= TIMEOUT + BOUND + 5,
        f"{since:.0f} s after the stall: {line}",
    )
    trace = run(
        [
            sys.executable,
            "-m",
            "torch.distributed.flight_recorder.fr_trace",
            out / "stalls",
            "--prefix",
            "nccl_trace_rank_",
            "-j",
        ],
        check=False,
    )
    listed = trace.stdout + trace.stderr  # it prints where its version does
    entries = re.findall(r"^\w+\(input_sizes=", listed, re.M)  # a line per collective it recorded
    check(
        "its Flight Recorder trace reads in fr_trace",
        trace.returncode == 0 and len(entries) > 0,
        f"exit {trace.returncode}, {len(entries)} collectives listed, the last: {listed.strip().splitlines()[-1]}",
    )


def images_on_the_gpu(tmp: Path) -> None:
    """An image folder trains on cuda with DataLoader workers (uint8 pinned, normalised on the
    GPU); and torchvision's GPU JPEG decoding of a batch, with each image's 224-pixel crop, against
    images.ImageFiles on one CPU core (docs/speed.md, "Image folders")."""
    from extras import images
    import torchvision
    from image_files import write_image_folder
    from torchvision.transforms.v2 import functional as TF

    root = write_image_folder(tmp / "varied", "varied", 4, 150, 20)
    out = tmp / "images-out"
    flags = ["--dataset", "imagefolder", "--data-dir", root, "--arch", "tiny", "--image-size", "24"]
    run(
        python(
            "distributed.py",
            *flags,
            "--batch-size",
            "32",
            "--epochs",
            "3",
            "--workers",
            "2",
            "--output-dir",
            out,
        )
    )
    acc = metrics(out)[-1]["val_acc"]
    check("an image folder trains on cuda with 2 workers", acc >= 0.9, f"val_acc {acc:.3f}")
    shaped = write_image_folder(tmp / "imagenet", "imagenet", 4, 64, 1) / "train"
    ours = images.ImageFiles(shaped, 224, 0, augment=True)
    files = [torchvision.io.read_file(path) for path, _ in ours.samples]
    boxes = [
        ours.random_crop(Image.open(path).size, i)[0] for i, (path, _) in enumerate(ours.samples)
    ]

    def gpu_batch() -> torch.Tensor:
        images = torchvision.io.decode_jpeg(files, device="cuda")
        crops = [
            TF.resized_crop(image, top, left, bottom - top, right - left, [224, 224])
            for image, (left, top, right, bottom) in zip(images, boxes)
        ]
        return torch.stack(crops)

    gpu_batch()  # the decoder's start-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        gpu_batch()
    torch.cuda.synchronize()
    gpu = 5 * len(files) / (time.perf_counter() - start)
    start = time.perf_counter()
    for i in range(len(ours)):
        ours[i]
    cpu = len(ours) / (time.perf_counter() - start)
    cores = len(os.sched_getaffinity(0))
    check(
        "GPU JPEG decoding against the workers' CPU decoding, measured",
        gpu > 0 and cpu > 0,
        f"{len(files)} ImageNet-shaped JPEGs, read beforehand: decode_jpeg on cuda with "
        f"224-pixel crops {gpu:.0f} images/s; images.ImageFiles {cpu:.0f} per CPU core, "
        f"x {cores} cores = {cpu * cores:.0f}",
    )


SYNCS_PER_STEP = (
    '''
import json
import os
import warnings

import torch
import torch.nn.functional as F

from extras import builtin


class SyncsPerStep:
    """Each synchronizing CUDA call the sync debug mode warns of, by where it was called, written a line per
    training step (from one training forward to the next) to $SYNCS."""

    def __init__(self):
        self.found, self.forwards = [], 0

    def seen(self, message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            self.found.append(f"{os.path.basename(filename)}:{lineno}")

    def step_begins(self, module, inputs):
        if not module.training:
            return
        if not self.forwards:
            warnings.simplefilter("always")
            warnings.showwarning = self.seen
            torch.cuda.set_sync_debug_mode("warn")
        self.forwards += 1
        with open(os.environ["SYNCS"], "a") as f:
            f.write(json.dumps(self.found) + "\\n")
        self.found = []


SYNCS = SyncsPerStep()
'''
    + PLUGGED
    + """

def compute_loss(outputs, targets):
    return F.cross_entropy(outputs, targets)
"""
)


def no_syncs(tmp: Path) -> None:
    """torch.cuda.set_sync_debug_mode("warn") over a run, its warnings counted per step: a step that records
    nothing makes no synchronizing CUDA call (tests/test_host_syncs.py follows the tensors on CPU); a recording
    step reads its numbers (and is seen to). And --profile on cuda: each rank's trace holds the GPU's kernels and the phases."""
    from projects import copy_with_your_functions

    runs = {
        "distributed.py": [],
        "distributed_amp.py bfloat16": ["--amp-dtype", "bfloat16"],
        "distributed_amp.py float16": ["--amp-dtype", "float16"],
        "distributed_fsdp.py": [],
        # the benchmark's bfloat16 row: ResNet-18, channels_last, batch 512, 8 workers; 32 steps
        "distributed_amp.py bfloat16, ResNet-18": [
            *("--amp-dtype", "bfloat16", "--channels-last", "--arch", "resnet18"),
            *(
                "--fake-size",
                "16384",
                "--image-size",
                "32",
                "--batch-size",
                "512",
                "--workers",
                "8",
            ),
        ],
    }
    for name, flags in runs.items():
        folder = tmp / ("syncs-" + re.sub(r"\W+", "-", name))
        copy = copy_with_your_functions(name.split()[0], folder, SYNCS_PER_STEP)
        counts = folder / "syncs.jsonl"
        # 32 steps of 1 epoch: records at 10, 20, 30 and 32
        run(
            python(
                copy,
                *TINY,
                "--epochs",
                "1",
                "--workers",
                "1",
                "--phases",
                *flags,
                "--output-dir",
                folder / "out",
            ),
            env={"SYNCS": str(counts)},
            cwd=folder,
        )
        intervals = [json.loads(line) for line in counts.read_text().splitlines()]
        per_step = {s: intervals[s + 1] for s in range(1, len(intervals) - 1)}
        # float16: GradScaler.step reads its inf check back, one sync a step (PyTorch's; the fused optimizers that
        # take the check on the device are not used: fused SGD moves its momentum on a skipped step)
        scaler = [[at for at in per_step[s] if at.startswith("grad_scaler.py")] for s in per_step]
        if "float16" in name:
            per_step = {
                s: [at for at in found if not at.startswith("grad_scaler.py")]
                for s, found in per_step.items()
            }
        quiet = {s: found for s, found in per_step.items() if s not in (10, 20, 30) and found}
        read = sum(len(per_step[s]) for s in (10, 20, 30)) / 3
        check(
            f"{name}: no sync in a step that records nothing",
            len(per_step) == 31 and not quiet and read > 0,
            f"{len(per_step)} steps, {sum(map(len, quiet.values()))} syncs in {len(quiet)} of the 28 quiet steps "
            f"{sorted(set(sum(quiet.values(), [])))[:4]}, {read:.0f} in a recording step; GradScaler's "
            f"{sum(map(len, scaler))} in {len(per_step)} steps",
        )
        last = [r for r in steps(folder / "out") if "phase_ms" in r][-1]
        print(f"  its last record: phases {last['phase_ms']}, slow {last['slow']}", flush=True)
    out = tmp / "profiled"
    result = run(
        python(
            "distributed_amp.py",
            *TINY,
            "--epochs",
            "1",
            "--amp-dtype",
            "bfloat16",
            "--profile",
            "3:5",
            "--output-dir",
            out,
        )
    )
    events = json.loads((out / "profile" / "rank0.json").read_text())["traceEvents"]
    kernels = sum(e.get("cat") == "kernel" for e in events)
    named = ("data", "forward + loss", "backward", "wait", "optimizer")
    phases = [e["name"] for e in events if e.get("cat") == "user_annotation" and e["name"] in named]
    mfu = [line for line in result.stdout.splitlines() if "mfu" in line][:1]
    check(
        "--profile 3:5 on cuda: the GPU's kernels and the phases",
        kernels > 0 and len(phases) == 15,
        f"{kernels} kernels, ranges {phases[:4]}; {mfu}",
    )


SECTIONS = {
    "syncs": no_syncs,
    "images": images_on_the_gpu,
    "task": your_task_on_the_gpu,
    "project": your_project_on_the_gpu,
    "stall": a_stall_on_the_gpu,
    "stream": a_stream_on_the_gpu,
    "launchers": launchers,
    "amp": mixed_precision,
    "fsdp": fully_sharded,
    "resnet": resnet,
    "graphs": cuda_graphs,
}

if __name__ == "__main__":
    main()
