"""distributed_amp.py, distributed_grad_accum.py, torch.compile, and the moving average of the weights (--ema, in
every script: its equalities are checked wherever the tiny job's weights are, see processes.py)."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
import torch.nn as nn

import utils
from extras import averages, checkpoints
from extras.profiles import PHASES
from processes import (
    EVAL_EVERY,
    MEASURED,
    ROOT,
    TINY,
    assert_same_records,
    max_weight_difference,
    metrics,
    python,
    run,
    run_parallel,
    steps,
    torchrun,
    weights,
)

SMALL = [*TINY, "--fake-size", "320", "--no-augment"]  # float16 is slow on a CPU


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mixed_precision_learns(dtype, tmp_path):
    out = tmp_path / dtype
    result = run(
        torchrun(
            2,
            "distributed_amp.py",
            *TINY,
            "--no-augment",
            "--amp-dtype",
            dtype,
            "--output-dir",
            out,
        )
    )
    assert f"autocast torch.{dtype}" in result.stdout
    final = metrics(out)[-1]
    assert final["val_acc"] > 0.5, final  # chance is 0.1
    assert (final["loss_scale"] is None) == (dtype == "bfloat16")


def test_float16_overflow_is_skipped_and_continues_exactly(tmp_path):
    """A loss scale of 2^30 overflows float16 gradients: those steps are skipped, the
    weights stay finite, and a continued run ends exactly where an uninterrupted one does. A
    skipped step is still a step of the phases: --profile 2:4 holds three of each phase."""
    args = [*SMALL, "--amp-dtype", "float16", "--init-scale", str(2.0**30)]
    straight = tmp_path / "straight"
    run(python("distributed_amp.py", *args, "--profile", "2:4", "--output-dir", straight))
    events = json.loads((straight / "profile" / "rank0.json").read_text())["traceEvents"]
    ranges = [e["name"] for e in events if e.get("ph") == "X" and e["name"] in PHASES]
    assert all(ranges.count(name) == 3 for name in PHASES[:5]), ranges  # no outer step
    run(
        python(
            "distributed_amp.py", *args, "--stop-after", "1", "--output-dir", tmp_path / "resumed"
        )
    )
    run(python("distributed_amp.py", *args, "--output-dir", tmp_path / "resumed"))
    first_epoch = metrics(tmp_path / "straight")[0]
    assert first_epoch["skipped_steps"] >= 10 and first_epoch["loss_scale"] < 2.0**30
    assert all(
        math.isfinite(v)
        for w in weights(tmp_path / "straight").values()
        for v in w.flatten().tolist()
    )
    assert max_weight_difference(tmp_path / "straight", tmp_path / "resumed") <= 1e-6
    learned = [
        [{k: v for k, v in m.items() if k not in MEASURED} for m in metrics(tmp_path / run)]
        for run in ("straight", "resumed")
    ]
    assert learned[0] == learned[1]  # losses, accuracies, skipped steps and loss scale alike


def test_accumulation_equals_one_big_batch(tmp_path, reference):
    """2 processes x 4 micro-batches of 4 == 1 process x batch 32: weights, epochs and the records of steps.jsonl,
    one per optimizer step, never per micro-batch."""
    out = tmp_path / "accum"
    run(
        torchrun(
            2,
            "distributed_grad_accum.py",
            *TINY,
            "--no-augment",
            *EVAL_EVERY,
            "--accum-steps",
            "4",
            "--output-dir",
            out,
        )
    )
    assert max_weight_difference(out, reference["one"]) <= 1e-5
    for a, b in zip(metrics(out), metrics(reference["one"])):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-5)
    assert_same_records(steps(out), steps(reference["one"]), tolerance=1e-5)


def test_gradients_are_all_reduced_once_per_optimizer_step(tmp_path):
    result = run(
        torchrun(
            2,
            "tests/count_allreduce.py",
            *TINY,
            "--no-augment",
            "--accum-steps",
            "4",
            "--output-dir",
            tmp_path,
        )
    )
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    assert counts["optimizer_steps"] == counts["micro_batches"] // 4 > 0
    assert counts["all_reduces"] == counts["optimizer_steps"]


def test_compiled_step_trains_the_same_model_with_plain_checkpoint_keys(tmp_path, reference):
    """--compile-mode reduce-overhead (CUDA graphs on a GPU; on the CPU inductor's kernels alone) with
    DDP splitting the compiled graph at its buckets: the same weights as eager, keys without _orig_mod."""
    out = tmp_path / "compiled"
    # one process, kernels compiled in it: inductor's pool of compile workers has crashed 2-process
    # runs on this 2-core machine at exit (SIGABRT after the last checkpoint), once in several runs
    run(
        python(
            "distributed.py",
            *TINY,
            "--no-augment",
            "--compile-mode",
            "reduce-overhead",
            "--output-dir",
            out,
        ),
        timeout=300,
        env={"TORCHINDUCTOR_COMPILE_THREADS": "1"},
    )
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in weights(out))
    assert max_weight_difference(out, reference["one"]) <= 1e-5


def test_the_moving_average_follows_its_decay_swaps_back_bit_for_bit_and_continues():
    """averages.EMA on a model with a tied weight and batch-norm buffers, inside DataParallel: plain names, each tensor
    once; after update n the average is lerp(average, weights, 1 - min(decay, (1 + n) / (10 + n))), its integer
    count a copy; swapped in for validation the model holds the average, and then its own weights bit for bit; its
    state continues in another run's EMA, and a run without --ema refuses it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))
    model[2].weight = model[0].weight
    ema = averages.EMA(nn.DataParallel(model), 0.9)
    assert list(ema.average) == [
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
        "2.bias",
        "1.running_mean",
        "1.running_var",
        "1.num_batches_tracked",
    ]
    expected = {name: tensor.clone() for name, tensor in ema.average.items()}
    for n in range(1, 31):
        model(torch.randn(8, 4))  # training: new batch-norm statistics
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update()
        decay = min(0.9, (1 + n) / (10 + n))  # 0.18 at the first update, 0.9 from the 80th
        current = dict([*model.named_parameters(), *model.named_buffers()])
        for name, average in expected.items():
            expected[name] = (
                average * decay + current[name] * (1 - decay)
                if average.is_floating_point()
                else current[name].clone()
            )
    for name, average in expected.items():
        assert torch.allclose(ema.average[name], average, atol=1e-6), name
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with ema.swapped():
        inside = model.state_dict()
        assert torch.equal(inside["2.weight"], inside["0.weight"])  # still tied
        assert all(
            torch.allclose(inside[name], average, atol=1e-6) for name, average in expected.items()
        )
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in weights.items())
    assert not torch.allclose(
        weights["0.weight"], expected["0.weight"]
    )  # an average, not the weights
    other = averages.EMA(model, 0.9)
    other.load_state_dict(ema.state_dict())
    assert other.updates == 30 and all(
        torch.equal(other.average[k], ema.average[k]) for k in ema.average
    )
    # a checkpoint written without --ema (its "ema" None) refuses to continue with it, and one with it without it
    with pytest.raises(ValueError, match="--ema"):
        averages.EMA(model, 0.9).load_state_dict(None)
    args = argparse.Namespace(arch="tiny", optimizer="sgd", epochs=2)
    with pytest.raises(
        utils.UsageError, match="does not fit .* holds ema, which this run keeps none of"
    ):
        checkpoints.restore(
            {"model": {}, "epoch": 1, "ema": ema.state_dict()}, "checkpoint.pt", args, ema=None
        )
    # one written without --ema before the average was an extra of its own (an average without tensors) continues
    assert checkpoints.restore(
        {"model": {}, "epoch": 1, "ema": {"updates": 0, "average": {}}},
        "checkpoint.pt",
        args,
        ema=None,
    ) == (1, 0)
    records = ema.evaluated(
        lambda: {"val_loss": float(model[0].weight.detach().sum()), "val_images": 8}
    )
    assert records["val_loss_ema"] == pytest.approx(
        float(expected["0.weight"].detach().sum()), abs=1e-5
    )
    assert (
        records["val_loss"] == pytest.approx(float(weights["0.weight"].detach().sum()))
        and "val_images_ema" not in records
    )


# a user's model with batch norm in 2-D and 1-D, smooth activations and no max-pool (so that float32 rounding flips
# no gradient between world sizes)
YOUR_BATCH_NORM = """
def build_datasets(args):
    from extras import builtin

    return builtin.datasets(args)


def build_model(args, num_classes):
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2),
        nn.BatchNorm2d(8),
        nn.GELU(),
        nn.Flatten(),
        nn.Linear(8 * 7 * 7, 16),
        nn.BatchNorm1d(16),
        nn.GELU(),
        nn.Linear(16, num_classes),
    )


def compute_loss(outputs, targets):
    return F.cross_entropy(outputs, targets)
"""
BATCH_NORM_JOB = [*TINY, "--batch-size", "64", "--epochs", "2", "--no-augment"]


def test_sync_bn_on_cpu_processes_trains_on_2_and_3_what_1_does(tmp_path):
    """--sync-bn on gloo: a batch-norm model on 2 processes and on 3 (parts 22/21/21 of 64) ends with the weights and
    running statistics of 1 process (1e-5), and records its validation loss; without --sync-bn, 2 processes train
    another model (each rank's statistics over its own part). The main job's ResNet-18 (its 20 batch-norm layers,
    random crops and flips) with --sync-bn on 2 processes trains what 1 does in a step (1e-5; measured 2.4e-7, and
    0.04 without --sync-bn): on random images its float32 rounding grows some 30 to 100 times a step after that, by
    machine and threads, in one process too (1 process with --sync-bn against none: 7e-6 after 1 step, 2e-4 after
    2; 2 processes against 1 after 2 steps: 2e-7 on one machine, 2.9e-5 on another)."""
    from projects import copy_with_your_functions, launch

    copy = copy_with_your_functions("distributed.py", tmp_path / "copy", YOUR_BATCH_NORM)
    outs = {(n, sync): tmp_path / f"{n}p-{sync}" for n, sync in [(1, 1), (2, 1), (3, 1), (2, 0)]}
    commands = [
        (launch(copy, n, *BATCH_NORM_JOB, *["--sync-bn"] * sync, "--output-dir", out), {}, tmp_path)
        for (n, sync), out in outs.items()
    ]
    resnet = [*TINY, "--arch", "resnet18", "--fake-size", "32", "--epochs", "1", "--sync-bn"]
    main_job = {n: tmp_path / f"resnet18-{n}p" for n in (1, 2)}
    commands += [
        (launch(ROOT / "distributed.py", n, *resnet, "--output-dir", out), {}, tmp_path)
        for n, out in main_job.items()
    ]
    run_parallel(commands, at_once=2)
    one = weights(outs[1, 1])
    assert any("running_var" in key for key in one) and metrics(outs[1, 1])[-1]["val_acc"] > 0.5
    for n in (2, 3):
        assert max_weight_difference(outs[n, 1], outs[1, 1]) <= 1e-5, n
        assert metrics(outs[n, 1])[-1]["val_loss"] == pytest.approx(
            metrics(outs[1, 1])[-1]["val_loss"], abs=1e-5
        )
    assert max_weight_difference(outs[2, 0], outs[1, 1]) > 1e-3
    difference = max_weight_difference(main_job[2], main_job[1])
    print(f"ResNet-18 with --sync-bn, 2 processes against 1: {difference:.2g}")
    assert sum("running_var" in key for key in weights(main_job[1])) == 20
    assert difference <= 1e-5
