"""For machines joined by an ordinary network. DDP's --comm-hook bf16 (gradients all-reduced in bfloat16): the main job
learns, and a stopped run continues exactly. distributed_diloco.py, proved as every script is: one inner step with
--outer-lr 1 and no outer momentum is DDP's step (SGD's momentum and weight decay are linear), H inner steps on one
process are plain training, a run stopped within an inner cycle continues exactly (every process's copy and inner
optimizer, and the outer momentum, are in the checkpoint), on another number of processes it ends in one line, its
records count the bytes each process sends, the main job learns at the defaults, and the first line names the outer
optimizer."""

from __future__ import annotations

import pytest

from processes import (
    README_JOB,
    TINY,
    ends_every_rank_with,
    max_weight_difference,
    metrics,
    python,
    run,
    run_parallel,
    steps,
    torchrun,
    weights,
)

EXACT = [*TINY, "--no-augment"]  # 32 steps an epoch, 3 epochs, a record every 10 steps
AS_DDP = ["--inner-steps", "1", "--outer-lr", "1", "--outer-momentum", "0"]
MAIN_JOB = [*README_JOB, "--epochs", "3"]  # H = 8: 6 outer steps


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """4 at a time: DDP and DiLoCo as DDP on 2 processes; plain training and DiLoCo of H = 8 on 1; DiLoCo of H = 7
    with the outer defaults on 2, straight, and stopped after epoch 1 (step 32: 4 steps into a cycle, with the outer
    momentum of 4 outer steps); the main job at the defaults; and with DDP's --comm-hook bf16, the main job, and the
    tiny job straight and stopped after epoch 1."""
    base = tmp_path_factory.mktemp("diloco")
    commands = {
        "ddp": torchrun(2, "distributed.py", *EXACT),
        "as ddp": torchrun(2, "distributed_diloco.py", *EXACT, *AS_DDP),
        "plain": python("distributed.py", *EXACT),
        "one process": python(
            "distributed_diloco.py",
            *EXACT,
            "--inner-steps",
            "8",
            "--outer-lr",
            "1",
            "--outer-momentum",
            "0",
        ),
        "straight": torchrun(2, "distributed_diloco.py", *EXACT, "--inner-steps", "7"),
        "stopped": torchrun(
            2, "distributed_diloco.py", *EXACT, "--inner-steps", "7", "--stop-after", "1"
        ),
        # H = 8: 6 outer steps, which DiLoCo's constant 0.9 overshoots (docs/many-machines.md)
        "main job": torchrun(2, "distributed_diloco.py", *MAIN_JOB),
        "bf16 main job": torchrun(2, "distributed.py", *MAIN_JOB, "--comm-hook", "bf16"),
        "bf16 straight": torchrun(2, "distributed.py", *EXACT, "--comm-hook", "bf16"),
        "bf16 stopped": torchrun(
            2, "distributed.py", *EXACT, "--comm-hook", "bf16", "--stop-after", "1"
        ),
    }
    results = run_parallel(
        [(cmd + ["--output-dir", base / name], None) for name, cmd in commands.items()],
        timeout=400,
        at_once=4,
    )
    return base, dict(zip(commands, results))


def test_one_inner_step_with_outer_lr_1_and_no_outer_momentum_trains_what_ddp_trains(runs):
    base, results = runs
    first = results["as ddp"].stdout.splitlines()[0]
    assert first.endswith("; H 1, outer Nesterov SGD lr 1, momentum 0"), first
    assert max_weight_difference(base / "as ddp", base / "ddp") <= 1e-5
    # H = 8 on 1 process: plain steps (its --ema averages the weights of outer steps alone, every 8th)
    one, plain = weights(base / "one process"), weights(base / "plain")
    assert max((one[k] - plain[k]).abs().max().item() for k in plain) <= 1e-5
    assert metrics(base / "as ddp")[-1]["val_acc"] > 0.9


def test_a_run_stopped_within_an_inner_cycle_continues_exactly_and_only_on_as_many_processes(runs):
    base, results = runs
    stopped = base / "stopped"
    first = results["stopped"].stdout.splitlines()[0]
    assert first.endswith("; H 7, outer Nesterov SGD lr 0.7, momentum 0.5"), first
    on_one = run(
        python("distributed_diloco.py", *EXACT, "--inner-steps", "7", "--output-dir", stopped),
        check=False,
        timeout=120,
    )
    ends_every_rank_with(
        on_one,
        "error: this checkpoint holds the copies and inner optimizers of 2 processes: "
        "continue it on 2 processes",
        ranks=1,
    )
    continued = run(
        torchrun(2, "distributed_diloco.py", *EXACT, "--inner-steps", "7", "--output-dir", stopped),
        timeout=180,
    )
    assert "1 of 3 epochs done" in continued.stdout
    assert max_weight_difference(stopped, base / "straight") <= 1e-6
    # the weights of the last outer step: before each epoch's end, and at the run's end
    assert [r["val_weights_step"] for r in steps(stopped) if "val_loss" in r] == [28, 63, 96]


def test_records_count_the_bytes_each_process_sends_and_the_main_job_learns(runs):
    base, _ = runs
    params = sum(
        t.nbytes for t in weights(base / "straight").values() if t.is_floating_point()
    )  # and statistics
    # a ring all-reduce of 2 processes sends the tensor once from each: at global steps 7, 14, ..., 91 and 96
    records = [r for r in steps(base / "straight") if "train_loss" in r]
    spans = [
        r["global_step"] - before
        for r, before in zip(records, [0] + [r["global_step"] for r in records])
    ]
    assert sum(r["sent_mb_per_step"] * span for r, span in zip(records, spans)) == pytest.approx(
        14 * params / 1e6
    )
    assert {r["sent_mb_per_step"] for r in steps(base / "one process") if "train_loss" in r} == {0}
    assert metrics(base / "main job")[-1]["val_acc"] >= 0.95


def test_gradients_all_reduced_in_bfloat16_learn_and_a_stopped_run_continues_exactly(runs):
    base, _ = runs
    stopped = base / "bf16 stopped"
    run(
        torchrun(2, "distributed.py", *EXACT, "--comm-hook", "bf16", "--output-dir", stopped),
        timeout=180,
    )
    assert max_weight_difference(stopped, base / "bf16 straight") <= 1e-6
    assert (
        0 < max_weight_difference(base / "bf16 straight", base / "ddp") < 0.05
    )  # rounded gradients, close ones
    assert metrics(base / "bf16 main job")[-1]["val_acc"] >= 0.9
