"""distributed_amp.py and distributed_grad_accum.py."""
from __future__ import annotations

import json
import math

import pytest

from processes import (EVAL_EVERY, TINY, assert_same_records, max_weight_difference, metrics, python, run, steps,
                       torchrun, weights)

SMALL = [*TINY, "--fake-size", "320", "--no-augment"]  # float16 is slow on a CPU


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mixed_precision_learns(dtype, tmp_path):
    out = tmp_path / dtype
    result = run(torchrun(2, "distributed_amp.py", *TINY, "--no-augment", "--amp-dtype", dtype,
                          "--output-dir", out))
    assert f"autocast torch.{dtype}" in result.stdout
    final = metrics(out)[-1]
    assert final["val_acc"] > 0.5, final  # chance is 0.1
    assert (final["loss_scale"] is None) == (dtype == "bfloat16")


def test_float16_overflow_is_skipped_and_continues_exactly(tmp_path):
    """A loss scale of 2^30 overflows float16 gradients: those steps are skipped, the
    weights stay finite, and a continued run ends exactly where an uninterrupted one does."""
    args = [*SMALL, "--amp-dtype", "float16", "--init-scale", str(2.0 ** 30)]
    run(python("distributed_amp.py", *args, "--output-dir", tmp_path / "straight"))
    run(python("distributed_amp.py", *args, "--stop-after", "1", "--output-dir", tmp_path / "resumed"))
    run(python("distributed_amp.py", *args, "--output-dir", tmp_path / "resumed"))
    first_epoch = metrics(tmp_path / "straight")[0]
    assert first_epoch["skipped_steps"] >= 10 and first_epoch["loss_scale"] < 2.0 ** 30
    assert all(math.isfinite(v) for w in weights(tmp_path / "straight").values() for v in w.flatten().tolist())
    assert max_weight_difference(tmp_path / "straight", tmp_path / "resumed") <= 1e-6
    measured = {"epoch_time_s", "images_per_s", "data_wait_s", "peak_mem_mb", "tflops"}  # vary per run
    learned = [[{k: v for k, v in m.items() if k not in measured} for m in metrics(tmp_path / run)]
               for run in ("straight", "resumed")]
    assert learned[0] == learned[1]  # losses, accuracies, skipped steps and loss scale alike


def test_accumulation_equals_one_big_batch(tmp_path, reference):
    """2 processes x 4 micro-batches of 4 == 1 process x batch 32: weights, epochs and the records of steps.jsonl,
    one per optimizer step, never per micro-batch."""
    out = tmp_path / "accum"
    run(torchrun(2, "distributed_grad_accum.py", *TINY, "--no-augment", *EVAL_EVERY, "--accum-steps", "4",
                 "--output-dir", out))
    assert max_weight_difference(out, reference["one"]) <= 1e-5
    for a, b in zip(metrics(out), metrics(reference["one"])):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-5)
    assert_same_records(steps(out), steps(reference["one"]), tolerance=1e-5)


def test_gradients_are_all_reduced_once_per_optimizer_step(tmp_path):
    result = run(torchrun(2, "tests/count_allreduce.py", *TINY, "--no-augment", "--accum-steps", "4",
                          "--output-dir", tmp_path))
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    assert counts["optimizer_steps"] == counts["micro_batches"] // 4 > 0
    assert counts["all_reduces"] == counts["optimizer_steps"]


def test_accumulation_rejects_an_uneven_micro_batch(tmp_path):
    result = run(python("distributed_grad_accum.py", *TINY, "--accum-steps", "3",
                        "--output-dir", tmp_path), timeout=60, check=False)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: --batch-size 32 does not split evenly over 1 processes x 3 micro-batches: "
        "use a multiple of 3")


def test_compiled_step_trains_the_same_model_with_plain_checkpoint_keys(tmp_path, reference):
    """--compile-mode reduce-overhead (CUDA graphs on a GPU; on the CPU inductor's kernels alone) with
    DDP splitting the compiled graph at its buckets: the same weights as eager, keys without _orig_mod."""
    out = tmp_path / "compiled"
    # one process, kernels compiled in it: inductor's pool of compile workers has crashed 2-process
    # runs on this 2-core machine at exit (SIGABRT after the last checkpoint), once in several runs
    run(python("distributed.py", *TINY, "--no-augment", "--compile-mode", "reduce-overhead", "--output-dir", out),
        timeout=300, env={"TORCHINDUCTOR_COMPILE_THREADS": "1"})
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in weights(out))
    assert max_weight_difference(out, reference["one"]) <= 1e-5
