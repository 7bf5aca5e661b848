"""distributed_fsdp.py: fully sharded data parallel trains what distributed.py trains, holds about 1/N of the model
state per rank, and its sharded checkpoint continues on another number of processes and after SIGTERM."""

from __future__ import annotations

import argparse
import copy
import math
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

import utils
from extras import builtin, checks
from extras.checkpoints import host_memory_available
from processes import (
    EVAL_EVERY,
    OFFLINE,
    PYTHON,
    ROOT,
    TINY,
    assert_same_records,
    assert_wandb_equals_the_records,
    ends_every_rank_with,
    finish,
    free_port,
    max_weight_difference,
    metrics,
    python,
    run,
    run_parallel,
    start,
    steps,
    torchrun,
    wait_for,
    weights,
)
from test_preemption import assert_killed_while_writing_continues, fill, small_disk  # noqa: F401
from test_records import assert_curves_equal_the_records
from projects import YOUR_LANGUAGE_MODEL, copy_with_your_functions, launch, users_code

EXACT = [*TINY, "--no-augment"]  # the reference job of conftest.py


def difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory) -> dict[str, Path]:
    """The reference job sharded over 2 processes, straight; and stopped after 2 epochs, then continued on 1, logging
    to W&B (offline)."""
    base = tmp_path_factory.mktemp("fsdp")
    stopped = [
        "--stop-after",
        "2",
        "--wandb",
        "ddp-scripts-tests",
        "--output-dir",
        base / "two-then-one",
    ]
    run_parallel(
        [
            (
                torchrun(
                    2, "distributed_fsdp.py", *EXACT, *EVAL_EVERY, "--output-dir", base / "two"
                ),
                {},
            ),
            (torchrun(2, "distributed_fsdp.py", *EXACT, *EVAL_EVERY, *stopped), OFFLINE),
        ]
    )
    run(python("distributed_fsdp.py", *EXACT, *EVAL_EVERY, *stopped[2:]), env=OFFLINE)
    return {"two": base / "two", "two then one": base / "two-then-one"}


def test_fsdp_on_two_processes_equals_ddp_on_one(fsdp, reference):
    d = max_weight_difference(fsdp["two"], reference["one"])
    print(f"FSDP, 2 processes vs distributed.py, 1 process: max weight difference {d:.1e}")
    assert d <= 1e-5
    for a, b in zip(metrics(fsdp["two"]), metrics(reference["one"])):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-5)
        assert (
            a["val_loss"] == pytest.approx(b["val_loss"], abs=1e-5)
            and a["val_images"] == b["val_images"] == 207
        )
    assert_same_records(
        steps(fsdp["two"]), steps(reference["one"]), tolerance=1e-5
    )  # the gradients' norm too
    # every rank wrote its own shard; the full weights have plain keys and load into the plain model
    assert sorted(p.name for p in (fsdp["two"] / "checkpoint").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    model = builtin.model("tiny", 10, 16)
    model.load_state_dict(weights(fsdp["two"]))
    assert_curves_equal_the_records(fsdp["two"])  # the run's picture, as every script draws it


def test_each_rank_holds_about_half_the_model_state_of_ddp(fsdp, reference):
    sharded, whole = metrics(fsdp["two"])[-1], metrics(reference["two"])[-1]
    state = {k: (sharded[k], whole[k]) for k in ("params_mb", "grads_mb", "optimizer_mb")}
    print(
        "MB per rank on 2 processes, FSDP vs DDP:",
        {k: f"{a:.4f} vs {b:.4f}" for k, (a, b) in state.items()},
    )
    for a, b in state.values():
        assert 0.45 <= a / b <= 0.55  # half, but for a shard rounded up by a few elements


def test_a_checkpoint_of_two_processes_continues_on_one(fsdp):
    out = fsdp["two then one"]
    assert [m["world_size"] for m in metrics(out)] == [2, 2, 1]
    d = max_weight_difference(out, fsdp["two"])
    print(
        f"2 processes for 2 epochs, then 1 for the third, vs 2 straight: max weight difference {d:.1e}"
    )
    assert d <= 1e-5
    assert_same_records(steps(out), steps(fsdp["two"]), tolerance=1e-5)
    assert_wandb_equals_the_records(out, runs=2)  # the sharded checkpoint kept the run's id


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mixed_precision_learns(dtype, tmp_path):
    """FSDP's MixedPrecisionPolicy computes in dtype; float16 adds the ShardedGradScaler."""
    out = tmp_path / dtype
    result = run(
        torchrun(2, "distributed_fsdp.py", *EXACT, "--amp-dtype", dtype, "--output-dir", out)
    )
    assert f"compute in torch.{dtype}" in result.stdout
    assert metrics(out)[-1]["val_acc"] > 0.5, metrics(out)  # chance is 0.1


def test_sigterm_mid_epoch_continues_exactly(tmp_path):
    """Two ranks started by hand (as srun starts them), SIGTERM to one: both stop after the same step, the sharded
    checkpoint and model.pt are written, and the same command continues to the weights of a straight run."""

    def by_hand(out, port):
        return [
            (
                python(
                    "distributed_fsdp.py",
                    *EXACT,
                    "--fake-size",
                    "3000",
                    "--epochs",
                    "1",
                    "--save-every",
                    "5",
                    "--ip",
                    "127.0.0.1",
                    "--port",
                    port,
                    "--output-dir",
                    out,
                ),
                {"RANK": str(r), "WORLD_SIZE": "2"},
            )
            for r in (0, 1)
        ]

    run_parallel(by_hand(tmp_path / "straight", free_port()))
    out = tmp_path / "preempted"
    ranks = [start(cmd, env) for cmd, env in by_hand(out, free_port())]
    wait_for(lambda: (out / "checkpoint" / ".metadata").exists(), 120, "the first checkpoint")
    time.sleep(0.3)
    assert all(proc.poll() is None for proc, _ in ranks), (
        "finished before the signal: make the epoch longer"
    )
    ranks[1][0].send_signal(signal.SIGTERM)
    results = [finish(proc, marker, timeout=60) for proc, marker in ranks]
    assert all(r.returncode == 128 + signal.SIGTERM for r in results), results[0].stderr
    assert results[0].stderr.strip().splitlines()[-1].startswith("stopped by SIGTERM after step ")
    assert (out / "model.pt").exists()  # the whole weights, also when stopped
    second = run_parallel(by_hand(out, free_port()))
    assert "0 of 1 epochs done and" in second[0].stdout
    d = max_weight_difference(out, tmp_path / "straight")
    print(f"continued after SIGTERM vs straight: max weight difference {d:.1e}")
    assert d <= 1e-6
    # records every 10 steps, checkpoints every 5: the sharded checkpoint keeps the sums the next record needs
    assert_same_records(steps(out), steps(tmp_path / "straight"), tolerance=1e-6)


def test_a_hugging_face_language_model_with_a_tied_head_trains(tmp_path):
    """GPT-2 from a small config: its blocks are the sharding units, its head stays tied to its embedding in the
    root unit, the (sum, count) token loss falls, and model.pt loads into a fresh GPT-2 of the config. With
    --activation-checkpointing (the model's own, with its dropout) it trains the same weights."""
    copy = copy_with_your_functions("distributed_fsdp.py", tmp_path / "copy", YOUR_LANGUAGE_MODEL)
    out = tmp_path / "out"
    flags = [
        "--batch-size",
        "32",
        "--epochs",
        "3",
        "--workers",
        "0",
        "--timeout",
        "60",
        "--optimizer",
        "adamw",
        "--lr",
        "1e-2",
    ]
    run_parallel(
        [
            (launch(copy, 2, *flags, "--output-dir", out), {}),
            (
                launch(
                    copy,
                    2,
                    *flags,
                    "--activation-checkpointing",
                    "--output-dir",
                    tmp_path / "recomputed",
                ),
                {},
            ),
        ],
        cwd=tmp_path,
    )
    assert max_weight_difference(tmp_path / "recomputed", out) <= 1e-6
    losses = [m["val_loss"] for m in metrics(out)]
    print(f"GPT-2 under FSDP, 2 processes: validation loss per token by epoch {losses}")
    # an untrained model's loss is about ln 64 = 4.16 a token; the ideal, about 0.4 (a sequence's first two tokens)
    assert losses == sorted(losses, reverse=True) and losses[-1] < math.log(64) / 2, losses
    yours = users_code(YOUR_LANGUAGE_MODEL)
    model = yours["GPT2LMHeadModel"](yours["CONFIG"])
    state = weights(out)
    model.load_state_dict(state)
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])  # trained tied
    assert model.lm_head.weight is model.transformer.wte.weight


YOUR_DROPOUT_MODEL = '''
import os


class Block(nn.Sequential):
    """A sharding unit with dropout; rank 0's first block notes its training forwards in $FORWARDS."""
    forwards = 0

    def forward(self, x):
        if self.training and self.note and os.environ.get("RANK", "0") == "0":
            Block.forwards += 1
            with open(os.environ["FORWARDS"], "w") as f:
                f.write(str(Block.forwards))
        return super().forward(x)


def build_datasets(args):  # the scripts' own data and loss: the built-in fake images
    from extras import builtin
    return builtin.datasets(args)


def compute_loss(outputs, targets):
    return F.cross_entropy(outputs, targets)


def build_model(args, num_classes):
    first, second = Block(nn.Linear(3 * 16 * 16, 64), nn.GELU(), nn.Dropout(0.3)), Block(nn.Linear(64, 64), nn.GELU())
    first.note, second.note = True, False
    return nn.Sequential(nn.Flatten(), first, second, nn.Linear(64, num_classes))
'''


def test_activation_checkpointing_recomputes_each_unit_and_trains_the_same_weights_with_dropout(
    tmp_path,
):
    """--activation-checkpointing runs each sharding unit's forward again in backward, with the random numbers of
    the first (dropout): the same weights, to 1e-6, under plain keys. --cpu-offload on CPU processes says in one
    line that it changes nothing, and trains so. And the model built on rank 0 alone draws dropout as DDP does,
    where each rank builds it (1e-5)."""
    copy, ddp = (
        copy_with_your_functions(script, tmp_path / script, YOUR_DROPOUT_MODEL)
        for script in ("distributed_fsdp.py", "distributed.py")
    )
    runs = {
        "plain": (copy, []),
        "recomputed": (copy, ["--activation-checkpointing", "--cpu-offload"]),
        "ddp": (ddp, []),
    }
    results = run_parallel(
        [
            (
                torchrun(
                    2, script, *EXACT, "--epochs", "2", *flags, "--output-dir", tmp_path / name
                ),
                {"FORWARDS": str(tmp_path / f"{name}.forwards")},
            )
            for name, (script, flags) in runs.items()
        ]
    )
    assert max_weight_difference(tmp_path / "plain", tmp_path / "ddp") <= 1e-5
    del runs["ddp"]
    forwards = {name: int((tmp_path / f"{name}.forwards").read_text()) for name in runs}
    assert forwards == {"plain": 1 + 2 * 32, "recomputed": 2 * (1 + 2 * 32)}, (
        forwards
    )  # the start-up step's too
    assert (
        "--cpu-offload: on CPU processes the state is in host memory already" in results[1].stdout
    )
    assert max_weight_difference(tmp_path / "recomputed", tmp_path / "plain") <= 1e-6
    assert list(weights(tmp_path / "recomputed")) == [
        "1.0.weight",
        "1.0.bias",
        "2.0.weight",
        "2.0.bias",
        "3.weight",
        "3.bias",
    ]


def test_hybrid_sharding_equals_ddp_and_its_checkpoint_continues_as_plain_fsdp(reference, tmp_path):
    """--replicate 2 on 4 processes: 2 replicas, each sharded over 2 ranks (a 2-D mesh), the data split over all 4.
    It trains what 1 DDP process trains (1e-5); stopped after 2 epochs, its checkpoint continues as plain FSDP on 2
    processes and on 1 (1e-5)."""
    hybrid = [*EXACT, *EVAL_EVERY, "--replicate", "2"]
    straight, _ = run_parallel(
        [
            (torchrun(4, "distributed_fsdp.py", *hybrid, "--output-dir", tmp_path / "four"), {}),
            (
                torchrun(
                    4,
                    "distributed_fsdp.py",
                    *hybrid,
                    "--stop-after",
                    "2",
                    "--output-dir",
                    tmp_path / "stopped",
                ),
                {},
            ),
        ],
        timeout=300,
    )
    assert "2 x 2 shards" in straight.stdout
    assert max_weight_difference(tmp_path / "four", reference["one"]) <= 1e-5
    assert_same_records(steps(tmp_path / "four"), steps(reference["one"]), tolerance=1e-5)
    for name in ("on-two", "on-one"):
        shutil.copytree(tmp_path / "stopped", tmp_path / name)
    run_parallel(
        [
            (
                torchrun(
                    2,
                    "distributed_fsdp.py",
                    *EXACT,
                    *EVAL_EVERY,
                    "--output-dir",
                    tmp_path / "on-two",
                ),
                {},
            ),
            (
                python(
                    "distributed_fsdp.py", *EXACT, *EVAL_EVERY, "--output-dir", tmp_path / "on-one"
                ),
                {},
            ),
        ],
        timeout=300,
    )
    for name in ("on-two", "on-one"):
        assert [m["world_size"] for m in metrics(tmp_path / name)] == [
            4,
            4,
            2 if name == "on-two" else 1,
        ]
        assert max_weight_difference(tmp_path / name, tmp_path / "four") <= 1e-5


YOUR_GPT2_SMALL = '''
import os
import resource

from transformers import GPT2Config, GPT2LMHeadModel


def collate(samples):
    """Stacked; its first call, the start-up check's, notes the rank's peak resident memory in MiB so far: the
    build, the sharding and the weights' broadcast, before the first forward gathers any unit."""
    path = os.path.join(os.environ["PEAKS"], os.environ.get("RANK", "0"))
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
        # the peaks are all this run has to show: it ends here, as a user's error ends a run
        if os.environ.get("END_AT_PEAKS"):
            raise RuntimeError("the peaks are noted")
    return torch.utils.data.default_collate(samples)


def build_datasets(args):  # random tokens: a run of one step
    ids = list(torch.randint(0, 50257, (24, 16), generator=torch.Generator().manual_seed(0)))
    return [(x, x) for x in ids[:16]], [(x, x) for x in ids[16:]], 50257


def build_model(args, num_classes):
    if os.environ.get("REFUSE_META") and torch.empty(0).is_meta:  # as a from_pretrained under the meta device
        raise RuntimeError("cannot build on the meta device")
    return GPT2LMHeadModel(GPT2Config())  # GPT-2 small: 124M parameters, 475 MiB in float32


def compute_loss(outputs, targets):
    logits, labels = outputs.logits[:, :-1], targets[:, 1:]
    return F.cross_entropy(logits.transpose(1, 2), labels, reduction="sum"), labels.numel()
'''


def test_the_model_is_built_once_and_the_other_ranks_hold_only_their_shards(tmp_path):
    """GPT-2 small on 2 processes: rank 1 builds it on the meta device and receives its shards, one tensor at a
    time, so before the first step its peak memory is its shards and the largest tensor (the 147 MiB embedding)
    above the interpreter's, well below rank 0's, which built the whole model (475 MiB, and the build's own
    temporaries); that run ends there, at the start-up check. A build_model that cannot build on meta (one warning
    line) leaves rank 1 as high as rank 0, as every rank built the whole model before, and trains."""
    copy = copy_with_your_functions("distributed_fsdp.py", tmp_path / "copy", YOUR_GPT2_SMALL)
    flags = [
        "--batch-size",
        "4",
        "--epochs",
        "1",
        "--steps-per-epoch",
        "1",
        "--workers",
        "0",
        "--momentum",
        "0",
        "--timeout",
        "120",
    ]
    # the build on meta trains in the phase table's run; the build on every rank trains here
    runs = {"once": {"END_AT_PEAKS": "1"}, "every rank": {"REFUSE_META": "1"}}
    for name in runs:
        (tmp_path / name).mkdir()
    results = run_parallel(
        [
            (
                launch(copy, 2, *flags, "--output-dir", tmp_path / name / "out"),
                {**env, "PEAKS": str(tmp_path / name)},
            )
            for name, env in runs.items()
        ],
        timeout=300,
        cwd=tmp_path,
        check=False,
    )
    for result, env in zip(results, runs.values()):
        if env.get("END_AT_PEAKS"):
            assert result.returncode != 0 and "the peaks are noted" in result.stderr, result.stderr
        else:
            assert result.returncode == 0, result.stderr
        assert ("cannot build on the meta device" in result.stdout) == bool(
            env.get("REFUSE_META")
        ), result.stdout
        # said before sharding: 124M float32 parameters (the tied head once), half a rank; SGD without momentum
        assert re.search(
            r"^each rank will hold 0\.50 GB: parameters 0\.25, gradients 0\.25, sgd state 0\.00; "
            r"\d+\.\d GB free for it \(cpu\)$",
            result.stdout,
            re.M,
        ), result.stdout
    peaks = {
        name: [float((tmp_path / name / str(rank)).read_text()) for rank in (0, 1)] for name in runs
    }
    print(f"peak resident memory before the first step, MiB, ranks 0 and 1: {peaks}")
    once, every = peaks["once"], peaks["every rank"]
    assert once[1] < once[0] - 200 and once[1] < every[1] - 150, (
        peaks
    )  # measured: 300 and 206 below
    assert abs(every[1] - every[0]) < 150, peaks


# fsdp_memory.py starts warm; its runs start as a user's do (torchrun), because a rank forked from a server counts
# as resident only the server's pages it touches: forked, GPT-2's build peaked at 0.48 GiB, below the model and an
# interpreter of its own
def test_the_phase_table_shows_each_phase_and_a_save_that_adds_little_beside_rank_0():
    """tools/fsdp_memory.py, which docs/fsdp.md runs by hand on GPT-2 large, on GPT-2 small (124M parameters, 0.46
    GiB): each rank's peak per phase through a run and its continuation, and the start-up line. The save (the
    sharded checkpoint; model.pt and hf/ gathered on rank 0) adds the whole model on rank 0, which writes it, and
    on rank 1 the host copy of its shards that the background write keeps (weights 0.25 GB and AdamW's 0.50: 0.70
    GiB) and less than a copy of the model: tensors in flight one at a time (measured before the background
    write: 0.17 to 0.35 GiB, with the 147 MiB embedding the largest)."""
    result = run(
        [PYTHON, ROOT / "tools" / "fsdp_memory.py", "--model", "gpt2", "--only", "FSDP"],
        timeout=600,
    )
    print(result.stdout)
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith("| approach")).strip("| ").split(" | ")
    rows = [
        dict(zip(header, line.strip("| ").split(" | ")))
        for line in lines
        if line.startswith("| FSDP |")
    ]
    assert [row["rank"] for row in rows] == ["0", "1"]
    for row in rows:  # every phase measured, above the interpreter's memory
        assert all(float(row[phase]) > 0.5 for phase in header[2 : header.index("save adds")]), row
    assert float(rows[1]["save adds"]) < 0.70 + 0.46 and float(rows[0]["save adds"]) >= 0.3, rows
    assert re.search(
        r"^FSDP: each rank will hold 1\.00 GB: parameters 0\.25, gradients 0\.25, adamw state 0\.50;",
        result.stdout,
        re.M,
    ), result.stdout


def test_the_memory_check_counts_the_frozen_models_bound_for_the_gpu(monkeypatch):
    """distributed_fsdp.py's start-up memory check on a GPU: a teacher built on the host but bound for the GPU is
    counted against the GPU's free memory, so a state that fits beside it alone fits and one that does not is
    refused in one line before sharding (sizes on the meta device; the GPU's free bytes given)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * 10**9, 80 * 10**9))
    args = argparse.Namespace(optimizer="adamw", momentum=0.9)
    # 1.0 GB of weights: each of 2 ranks holds 2.0 with their gradients and AdamW's state
    model = torch.nn.Linear(10_000, 25_000, bias=False, device="meta")
    teacher = torch.nn.Linear(10_000, 20_000, bias=False, device="meta")  # 0.8 GB
    gpu = torch.device("cuda", 0)
    checks.check_state_fits(model, 2, args, gpu, 0.0, {})  # 2.0 GB of 3.0 free
    checks.check_state_fits(model, 2, args, gpu, 0.0, {"teacher": teacher})  # of 2.2
    with pytest.raises(
        utils.UsageError, match=r"each rank will hold 2\.00 GB: .* 1\.4 GB free for it \(cuda\)"
    ):
        checks.check_state_fits(
            model, 2, args, gpu, 0.0, {"a": teacher, "b": copy.deepcopy(teacher)}
        )


def test_the_docs_hugging_face_recipe_reads_the_checkpoint_once_and_trains_from_it(tmp_path):
    """docs/fsdp.md's build_model (from_pretrained on rank 0, from_config on the others, there on the meta device),
    pasted with the small GPT-2's data and loss, on a checkpoint saved with save_pretrained: rank 1 builds on meta
    (no warning), and with --lr 0 the trained weights are the pretrained ones."""
    page = (ROOT / "docs" / "fsdp.md").read_text()
    recipe = re.search(
        r"```python\n(.*?)```", page[page.index("A Hugging Face model from a checkpoint") :], re.S
    )[1]
    yours = users_code(YOUR_LANGUAGE_MODEL)
    pretrained = yours["GPT2LMHeadModel"](yours["CONFIG"])
    pretrained.save_pretrained(tmp_path / "gpt2")
    code = YOUR_LANGUAGE_MODEL.replace(
        "def build_model(", "def replaced_build_model("
    ) + recipe.replace("path/to/checkpoint", str(tmp_path / "gpt2"))
    code = f"import torch.distributed as dist\n{code}"
    copy = copy_with_your_functions("distributed_fsdp.py", tmp_path / "copy", code)
    result = run(
        launch(
            copy,
            2,
            "--batch-size",
            "32",
            "--epochs",
            "1",
            "--workers",
            "0",
            "--timeout",
            "60",
            "--lr",
            "0",
            "--output-dir",
            tmp_path / "out",
        ),
        cwd=tmp_path,
    )
    assert "cannot build on the meta device" not in result.stdout + result.stderr
    assert difference(weights(tmp_path / "out"), pretrained.state_dict()) == 0.0


def test_a_full_disk_ends_every_rank_with_one_line_and_keeps_the_last_checkpoint(small_disk, fsdp):
    """Every rank writes its shard into checkpoint.new/, so a full disk fails a write on some rank: every rank
    ends with one line, the last complete checkpoint stays in place, and once there is space the same command
    continues to the weights of a straight run."""
    out = small_disk / "run"
    run(torchrun(2, "distributed_fsdp.py", *EXACT, "--stop-after", "1", "--output-dir", out))
    filler = fill(small_disk, leave=16 * 1024)  # the metrics line fits, the shards do not
    full = run(torchrun(2, "distributed_fsdp.py", *EXACT, "--output-dir", out), check=False)
    ends_every_rank_with(
        full,
        f"error: cannot write {out / 'checkpoint.new'}: No space left on device: free space "
        f"or use another --output-dir",
    )
    filler.unlink()
    second = run(torchrun(2, "distributed_fsdp.py", *EXACT, "--output-dir", out))
    assert "continuing from" in second.stdout and "1 of 3 epochs done" in second.stdout
    assert [m["epoch"] for m in metrics(out)] == [1, 2, 3]
    assert max_weight_difference(out, fsdp["two"]) <= 1e-6


# A slow disk for the sharded save: rank 0's writing thread waits WRITE_SECONDS before the .metadata that makes
# checkpoint.new/ whole, the shard files already there.
SLOW_SHARDS = """
import threading as _threading
import time as _time

_real_finish = dcp.FileSystemWriter.finish


def _slow_finish(self, *args, **kwargs):
    if _threading.current_thread() is not _threading.main_thread():
        _time.sleep(float(os.environ.get("WRITE_SECONDS", "0")))
    return _real_finish(self, *args, **kwargs)


dcp.FileSystemWriter.finish = _slow_finish


"""


def test_a_run_killed_while_its_shards_are_written_in_the_background_continues_exactly(
    tmp_path, fsdp
):
    """Every rank's shards copied and written by a thread while training goes on: with rank 0's .metadata 1.5 s
    late, the ranks train on while checkpoint.new/ is written, and every process is SIGKILLed then. The same
    command continues from the last whole checkpoint to the straight run's weights (1e-6), each step's record
    once."""
    out = tmp_path / "out"
    writing = lambda: (out / "checkpoint.new").exists()  # noqa: E731
    assert_killed_while_writing_continues(
        "distributed_fsdp.py", SLOW_SHARDS, writing, out, fsdp["two"]
    )
    assert not writing()


def test_a_sharded_checkpoint_that_cannot_be_read_ends_every_rank_with_one_line(tmp_path):
    """A sharded checkpoint whose .metadata is broken (a disk error, a copy cut short) is named in one line on every
    rank, as a broken checkpoint.pt is, never a traceback from the continuation."""
    (tmp_path / "out" / "checkpoint").mkdir(parents=True)
    (tmp_path / "out" / "checkpoint" / ".metadata").write_bytes(b"not a checkpoint")
    result = run(
        torchrun(2, "distributed_fsdp.py", *TINY, "--output-dir", tmp_path / "out"),
        timeout=120,
        check=False,
    )
    ends_every_rank_with(
        result,
        f"error: {tmp_path / 'out' / 'checkpoint'} is not readable or does not fit this model",
    )


def test_a_checkpoint_that_does_not_fit_the_flags_ends_in_one_line_naming_what_it_lacks(tmp_path):
    """A sharded checkpoint written without --ema, continued with it: dcp's error (a BaseException, which no
    `except Exception` catches) is one line naming the key the checkpoint lacks, not a traceback."""
    out = tmp_path / "out"
    flags = [
        *TINY[: TINY.index("--ema")],
        "--epochs",
        "2",
        "--stop-after",
        "1",
        "--output-dir",
        out,
    ]
    run(python("distributed_fsdp.py", *flags))
    result = run(python("distributed_fsdp.py", *flags, "--ema", "0.9"), check=False)
    ends_every_rank_with(
        result,
        f"error: {out / 'checkpoint'} is not readable or does not fit this model or these flags (Missing key in"
        " checkpoint state_dict: ema.updates.)",
        ranks=1,
    )


@pytest.mark.parametrize("flag", [["--sync-bn"], ["--comm-hook", "bf16"]])
def test_flags_of_ddp_end_in_one_line(flag, tmp_path):
    """DDP's own flags are the DDP scripts' (their parse_args adds them): FSDP's parser does not know them."""
    result = run(
        python("distributed_fsdp.py", *TINY, *flag, "--output-dir", tmp_path),
        timeout=60,
        check=False,
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: unrecognized arguments: {' '.join(flag)} (see distributed_fsdp.py --help)"
    ], result.stderr


def test_a_gloo_that_sums_for_the_average_is_named_in_one_line_on_every_rank(tmp_path):
    """FSDP averages the gradients with reduce_scatter(AVG); PyTorch 2.8's gloo sums instead (seen: 2.0 for two
    ranks' 1.0), so 2 CPU processes took steps twice too large. That gloo is stood in for here."""
    (tmp_path / "sitecustomize.py").write_text(
        "import torch.distributed as dist\n"
        "summed = dist.reduce_scatter_tensor\n"
        "def older(output, input, op=dist.ReduceOp.SUM, **kwargs):\n"
        "    return summed(output, input, op=dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op, **kwargs)\n"
        "dist.reduce_scatter_tensor = older\n"
    )
    result = run(
        torchrun(2, "distributed_fsdp.py", *TINY, "--output-dir", tmp_path / "out"),
        timeout=120,
        check=False,
        env={"PYTHONPATH": str(tmp_path)},
    )
    ends_every_rank_with(
        result, f"error: PyTorch {torch.__version__}'s gloo sums where FSDP averages"
    )


YOUR_MODEL_BEYOND_THE_MACHINE = """
import os


def build_datasets(args):
    data = [(torch.zeros(4), 0)] * 8
    return data, data, 2


def build_model(args, num_classes):  # a parameter of FLOATS never written to: its pages are never touched
    return torch.nn.ParameterList([torch.nn.Parameter(torch.empty(int(os.environ["FLOATS"])))])


def compute_loss(outputs, targets):
    return F.cross_entropy(outputs, targets)
"""


def test_a_state_beyond_the_machine_ends_every_rank_in_one_line_before_sharding(tmp_path):
    """The start-up line says what each rank will hold. A model of 0.6 x the host's available memory (allocated,
    never touched, so it costs nothing here) with AdamW would need 2.4 x it over 2 processes, where the host has at
    most 1.6 x (what is available, and the model itself once sharded): every rank ends with one line that says so
    before any shard exists, not by the out-of-memory killer mid-step."""
    available = host_memory_available()  # what the script reads
    copy = copy_with_your_functions(
        "distributed_fsdp.py", tmp_path / "copy", YOUR_MODEL_BEYOND_THE_MACHINE
    )
    result = run(
        launch(
            copy,
            2,
            "--batch-size",
            "4",
            "--epochs",
            "1",
            "--workers",
            "0",
            "--optimizer",
            "adamw",
            "--timeout",
            "60",
            "--output-dir",
            tmp_path / "out",
        ),
        timeout=120,
        cwd=tmp_path,
        check=False,
        env={"FLOATS": str(int(0.6 * available / 4))},
    )
    ends_every_rank_with(result, "error: each rank will hold")
    line = next(
        line for line in result.stderr.splitlines() if line.startswith("error: each rank will hold")
    )
    assert "it cannot fit: use more processes" in line and "adamw state" in line, line
    assert not (tmp_path / "out" / "checkpoint").exists()
