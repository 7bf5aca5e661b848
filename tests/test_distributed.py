"""distributed.py: the equivalences that make DDP trustworthy, launch modes, errors."""

from __future__ import annotations

import argparse
import re
import xml.etree.ElementTree as ET
import shlex
import types
import shutil
import socket

import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

import distributed
import processes
from extras import builtin
import utils
from extras import slurm

from processes import (
    PYTHON,
    ROOT,
    TINY,
    assert_same_records,
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
    warm_starts,
    weights,
)
from projects import copy_core, copy_with_your_functions


def test_two_processes_equal_one_with_twice_the_batch(reference):
    """2 x batch 16 == 1 x batch 32: weights, logged training loss and validation."""
    assert max_weight_difference(reference["one"], reference["two"]) <= 1e-5
    one, two = metrics(reference["one"]), metrics(reference["two"])
    assert [m["epoch"] for m in one] == [m["epoch"] for m in two] == [1, 2, 3]
    assert [m["world_size"] for m in two] == [2, 2, 2]
    for a, b in zip(one, two):
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-5)
        assert b["train_acc"] == pytest.approx(a["train_acc"], abs=1e-9)
        # 207 images over 2 ranks: 104 + 103, none padded, none dropped
        assert a["val_images"] == b["val_images"] == 207
        assert b["val_acc"] == a["val_acc"]
        assert b["val_loss"] == pytest.approx(a["val_loss"], abs=1e-5)


def test_records_every_few_steps_of_two_processes_equal_one(reference):
    """steps.jsonl: a training record every --print-freq 10 steps and at each epoch's 32nd, the mean over every
    rank's samples since the previous record; validation at steps 12 and 24 (--eval-every) and at each epoch's end,
    every image once. Rank 0 alone writes it, with all ranks' numbers."""
    one, two = steps(reference["one"]), steps(reference["two"])
    assert_same_records(two, one, tolerance=1e-5)
    train = [r for r in one if "train_loss" in r]
    assert [(r["epoch"], r["step"]) for r in train[:5]] == [
        (1, 10),
        (1, 20),
        (1, 30),
        (1, 32),
        (2, 10),
    ]
    assert [r["global_step"] for r in train][-4:] == [74, 84, 94, 96]
    validation = [r for r in two if "val_loss" in r]
    assert [r["global_step"] for r in validation] == [12, 24, 32, 44, 56, 64, 76, 88, 96]
    assert all(r["val_images"] == 207 for r in validation)
    ends = [
        r for r in validation if r["step"] == 32
    ]  # the epoch ends' validation is metrics.jsonl's
    assert [r["val_loss"] for r in ends] == [m["val_loss"] for m in metrics(reference["two"])]
    assert all(
        r["grad_norm"] > 0 and r["images_per_s"] > 0 and r["peak_mem_mb"] > 0 and r["lr"] > 0
        for r in train[:-1]
    )
    assert "items_per_s" not in train[0]  # a mean loss: samples are the items


def test_fake_data_is_learnable(reference):
    final = metrics(reference["two"])[-1]
    assert final["val_acc"] > 0.6, final  # chance is 0.1
    assert final["train_loss"] < metrics(reference["two"])[0]["train_loss"]


def test_default_recipe_with_augmentation_learns_alike_on_1_and_2_processes(tmp_path):
    """No --lr: 0.1 x batch / 256, a warm-up and a cosine decay per step. With augmentation too,
    a global batch's crops and flips come from (seed, epoch, step), so 1 and 2 processes train one model."""
    run(python("distributed.py", *TINY, "--output-dir", tmp_path / "one"))
    two = run(torchrun(2, "distributed.py", *TINY, "--output-dir", tmp_path / "two"))
    assert "peak lr 0.0125" in two.stdout  # 0.1 x 32 / 256
    one, two = metrics(tmp_path / "one")[-1], metrics(tmp_path / "two")[-1]
    assert (
        one["val_acc"] > 0.9
        and two["val_acc"] > 0.9
        and abs(one["val_acc"] - two["val_acc"]) <= 0.02
    )
    assert max_weight_difference(tmp_path / "one", tmp_path / "two") <= 1e-5


def test_four_times_the_batch_without_lr_still_learns(tmp_path):
    result = run(
        torchrun(2, "distributed.py", *TINY, "--batch-size", "128", "--output-dir", tmp_path)
    )
    assert "peak lr 0.05" in result.stdout  # the rate follows the batch
    assert metrics(tmp_path)[-1]["val_acc"] > 0.9


def readme_main_job(output_dir) -> list:
    """The README's first command, without its install step, writing to output_dir."""
    line = next(
        line
        for line in (ROOT / "README.md").read_text().splitlines()
        if "pip install" in line and "torchrun" in line
    )
    words = shlex.split(line.split("&&", 1)[1])
    assert words[0] == "torchrun" and words[words.index("--output-dir") + 1] == "output"
    words[words.index("--output-dir") + 1] = str(output_dir)
    return [PYTHON, "-m", "torch.distributed.run", *words[1:]]


# what a run of the same command prints otherwise on another machine or load: decimals, the speed,
# the rank that waited longest, the time left
VARYING = {
    r"\d+\\\.\d+": r"[-+.e\d]+",  # in any of format(x, ".4g")'s forms: 1234, 0.0123, 1.2e-05
    r"\d+(?=\\ img/s)": r"\d+",
    r"(?<=data_wait_rank\\ )\d+": r"\d+",
    r"(?<=peak_mem_mb\\ )\d+(?=\\ )": r"[-+.e\d]+",  # 4 digits: 986.2, or 1019
    r"(?<=left\\ )\d+:\d+:\d+": r"\d+:\d+:\d+",
}


def printed_as(line: str) -> str:
    """A regular expression of line in which what varies (VARYING) may be any number."""
    pattern = re.escape(line)
    for varying, anything in VARYING.items():
        pattern = re.sub(varying, lambda _: anything, pattern)  # anything as it is, no escapes
    return pattern


def readme_sample_lines() -> list[str]:
    """The lines the README shows the main job printing ("..." aside)."""
    block = (ROOT / "README.md").read_text().split("It prints a record", 1)[1].split("\n\n")[1]
    return [line.strip() for line in block.splitlines() if line.strip() != "..."]


A_STREAM = """
class Numbers(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in range(64):
            yield torch.full((1, 8, 8), float(i % 4)), i % 4


def build_datasets(args):
    return Numbers(), Numbers(), 4


def build_model(args, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))


def compute_loss(outputs, targets):
    return F.cross_entropy(outputs, targets)
"""


@pytest.mark.real_launch  # the launch itself
def test_the_readme_main_job_learns_from_the_files_a_user_copies(tmp_path):
    """The README's main job, run in a folder that holds only distributed.py, utils.py and extras/, learns; so
    does distributed_fsdp.py with them alone (the tiny job), and distributed.py given a stream. utils.py copied as
    ddp_utils.py beside a project's own utils.py (which raises on import), the script's and the extras' imports
    changed (the README's sed), trains with DataLoader workers, never importing the project's own (tests/test_stalls.py names a
    stall there)."""
    alone, fsdp, stream = tmp_path / "alone", tmp_path / "fsdp", tmp_path / "stream"
    for folder, script in ((alone, "distributed.py"), (fsdp, "distributed_fsdp.py")):
        copy_core(ROOT, folder)
        shutil.copy(ROOT / script, folder)
    main_job = readme_main_job(tmp_path / "out")
    main_job[main_job.index("distributed.py")] = str(alone / "distributed.py")
    copy = copy_with_your_functions("distributed.py", stream, A_STREAM)
    beside = copy_with_your_functions(
        "distributed.py",
        tmp_path / "beside",
        None,
        folder="ddp_utils",
    )
    small = ["--dataset", "fake", "--fake-size", "512", "--batch-size", "64", "--epochs", "1"]
    small += ["--arch", "tiny"]
    # the README's command as a user runs it; the other three, whose launch is not what they check, warm
    readme = start(main_job, {}, alone)
    with warm_starts():
        results = run_parallel(
            [
                (
                    torchrun(
                        2, str(fsdp / "distributed_fsdp.py"), *small, "--output-dir", fsdp / "out"
                    ),
                    {},
                    fsdp,
                ),
                (
                    [
                        PYTHON,
                        copy,
                        "--steps-per-epoch",
                        "2",
                        "--batch-size",
                        "8",
                        "--epochs",
                        "1",
                        "--workers",
                        "0",
                        "--output-dir",
                        stream / "out",
                    ],
                    {},
                    stream,
                ),
                (
                    torchrun(
                        2,
                        str(beside),
                        *small,
                        "--workers",
                        "2",
                        "--output-dir",
                        beside.parent / "out",
                    ),
                    {},
                    beside.parent,
                ),
            ],
            timeout=300,
            check=False,
        )
    result = finish(*readme, timeout=300)
    sharded, streamed, renamed = results
    assert result.returncode == 0, result.stderr
    assert sharded.returncode == 0 and metrics(fsdp / "out")[-1]["val_acc"] > 0.3, sharded.stderr
    assert streamed.returncode == 0 and len(metrics(stream / "out")) == 1, streamed.stderr
    assert "import ddp_utils" in beside.read_text() and "import utils" not in beside.read_text()
    assert "from ddp_utils import" in (beside.parent / "extras" / "batches.py").read_text()
    assert renamed.returncode == 0 and metrics(beside.parent / "out")[-1]["val_acc"] > 0.3, (
        renamed.stderr
    )
    tmp_path = tmp_path / "out"
    assert "world size 2" in result.stdout
    # standard error a pipe: no live line (extras/live.py), no carriage return
    assert "\r" not in result.stdout + result.stderr
    records = metrics(tmp_path)
    final = records[-1]
    assert final["val_acc"] >= 0.9 and final["val_acc_ema"] >= 0.9, (
        final
    )  # ten classes: chance is 0.1
    # the README's sample lines, each printed, whatever digits this machine's floating point gives
    for line in readme_sample_lines():
        shown = printed_as(line)
        assert re.search(f"^{shown}$", result.stdout, re.M), (line, result.stdout)
    # and each line printed one the README shows, its figures and epoch aside: no line of the project's own
    # that the README lacks (a warning about its own recipe)
    shapes = [
        re.sub(r"epoch\\ \d+/", lambda _: r"epoch\ \d+/", printed_as(line))
        for line in readme_sample_lines()
    ]
    unshown = [
        line
        for line in result.stdout.splitlines()
        if not any(re.fullmatch(shape, line) for shape in shapes)
    ]
    assert not unshown, unshown
    # and on standard error torchrun's note (that it sets OMP_NUM_THREADS) alone: no warning
    said = [line for line in result.stderr.splitlines() if "torch/distributed/run.py" not in line]
    assert not [line for line in said if line.strip()], result.stderr
    # a record's time left is the run's: after epoch 1 of 3, two epochs' worth
    first = re.search(
        r"^epoch 1/3 step 16/16 train_loss .* left (\d+):(\d+):(\d+)$", result.stdout, re.M
    )
    assert first and first.groups() != ("0", "00", "00"), result.stdout
    for m in records:  # each epoch's line printed once, by rank 0, with the numbers of all ranks
        shown = " ".join(
            f"{k} {m[k]:.4f}"
            for k in ("train_loss", "train_acc", "val_loss", "val_acc", "val_acc_ema")
        )
        assert result.stdout.count(f"epoch {m['epoch']}/{len(records)} {shown} time ") == 1, shown


def test_continued_run_equals_uninterrupted_run(tmp_path, reference):
    """2 processes stop after 2 epochs; 1 process continues the third: the weights and their moving average equal
    an uninterrupted run's (1e-5: another number of processes; the same number continues to 1e-6 in
    test_preemption.py and test_records.py)."""
    out = tmp_path / "run"
    first = run(
        torchrun(
            2, "distributed.py", *TINY, "--no-augment", "--stop-after", "2", "--output-dir", out
        )
    )
    assert "continuing" not in first.stdout
    assert [m["epoch"] for m in metrics(out)] == [1, 2]
    second = run(python("distributed.py", *TINY, "--no-augment", "--output-dir", out))
    assert "continuing from" in second.stdout and "2 of 3 epochs done" in second.stdout
    assert [m["epoch"] for m in metrics(out)] == [1, 2, 3] and metrics(out)[-1]["world_size"] == 1
    assert max_weight_difference(out, reference["one"]) <= 1e-5
    for key in ("val_loss", "val_loss_ema"):
        assert metrics(out)[-1][key] == pytest.approx(metrics(reference["one"])[-1][key], abs=1e-5)


def test_validation_uses_rank_0s_batch_norm_statistics_on_every_rank(tmp_path):
    """DDP does not broadcast batch-norm buffers before each forward here, so each rank's
    running statistics drift apart; evaluation must still score every rank's shard with
    rank 0's, the ones the checkpoint keeps. Checked against the checkpoint scored in this process."""
    out = tmp_path / "out"
    run(
        torchrun(
            2,
            "distributed.py",
            "--dataset",
            "fake",
            "--arch",
            "resnet18",
            "--fake-size",
            "210",
            "--image-size",
            "16",
            "--batch-size",
            "32",
            "--epochs",
            "1",
            "--workers",
            "0",
            "--output-dir",
            out,
        )
    )
    logged = metrics(out)[-1]
    model = builtin.model("resnet18", 10, 16)
    model.load_state_dict(weights(out))
    args = argparse.Namespace(
        dataset="fake", fake_size=210, image_size=16, seed=0, no_augment=False, channels_last=False
    )
    _, val_set, _ = builtin.datasets(args)
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    try:  # a world of one in this process, as the script has
        loader = DataLoader(
            val_set, 64, collate_fn=utils.Counted(distributed.collate)
        )  # as the script makes it
        # no watchdog thread in pytest's process: what evaluate tells it, taken and dropped; no
        # metrics of a user's (build_metrics); the rest of the loop's state is evaluate's no concern
        watchdog = types.SimpleNamespace(batch=lambda *key: None)
        training = types.SimpleNamespace(
            model=model,
            val_loader=loader,
            args=args,
            device=torch.device("cpu"),
            watchdog=watchdog,
            val_metrics=None,
        )
        scored = distributed.evaluate(training)
    finally:
        torch.distributed.destroy_process_group()
    assert scored["val_images"] == logged["val_images"] == 42
    assert scored["val_loss"] == pytest.approx(logged["val_loss"], rel=1e-5)
    assert scored["val_acc"] == logged["val_acc"]


def launch_commands(mode: str, out, tmp_path) -> list[tuple[list, dict]]:
    """The same 2-process job started in each documented way."""
    args = [*TINY, "--no-augment", "--output-dir", out]
    port = free_port()
    if mode == "torch.distributed.launch":
        return [
            (
                [
                    PYTHON,
                    "-m",
                    "torch.distributed.launch",
                    "--nproc_per_node=2",
                    f"--master_port={port}",
                    "distributed.py",
                    *args,
                ],
                {},
            )
        ]
    if mode == "ip-port":  # two hand-started processes, as on two machines
        return [
            (
                python("distributed.py", *args, "--ip", "127.0.0.1", "--port", port),
                {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r)},
            )
            for r in range(2)
        ]
    if mode == "file-url":
        return [
            (
                torchrun(
                    2, "distributed.py", *args, "--dist-url", f"file://{tmp_path / 'rendezvous'}"
                ),
                {},
            )
        ]
    if mode == "slurm":  # srun sets these; no torchrun
        return [
            (
                python("distributed.py", *args),
                {
                    "SLURM_PROCID": str(r),
                    "SLURM_NTASKS": "2",
                    "SLURM_LOCALID": str(r),
                    "SLURM_JOB_NODELIST": "localhost",
                    "MASTER_PORT": str(port),
                },
            )
            for r in range(2)
        ]
    raise ValueError(mode)


@pytest.mark.real_launch  # the launch itself
@pytest.mark.parametrize("mode", ["torch.distributed.launch", "ip-port", "file-url", "slurm"])
def test_every_launch_mode_trains_the_same_model(mode, tmp_path, reference):
    out = tmp_path / "out"
    run_parallel(launch_commands(mode, out, tmp_path))
    assert [m["world_size"] for m in metrics(out)] == [2, 2, 2]
    assert max_weight_difference(out, reference["two"]) <= 1e-6


def test_image_folder_counts_every_validation_image(tmp_path):
    data = tmp_path / "data"
    for split, per_class in (("train", 12), ("val", 5)):
        for c, colour in enumerate([(200, 30, 30), (30, 200, 30), (30, 30, 200)]):
            folder = data / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (20 + i, 24), colour).save(folder / f"{i}.png")
    out = tmp_path / "out"
    run(
        torchrun(
            2,
            "distributed.py",
            "--dataset",
            "imagefolder",
            "--data-dir",
            data,
            "--arch",
            "tiny",
            "--image-size",
            "16",
            "--batch-size",
            "8",
            "--epochs",
            "1",
            "--workers",
            "1",
            "--output-dir",
            out,
        )
    )
    assert metrics(out)[0]["val_images"] == 15  # 3 classes x 5: an odd count over 2 ranks
    assert weights(out)["11.weight"].shape == (
        3,
        64 * 16,
    )  # the head has one output per class folder


def occupied_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def corrupt_checkpoint(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"not a checkpoint")
    return ["--output-dir", out]


def other_arch_checkpoint(tmp_path):
    out = tmp_path / "out"
    run(python("distributed.py", *TINY, "--epochs", "1", "--fake-size", "64", "--output-dir", out))
    return ["--output-dir", out, "--arch", "resnet18"]


BAD_INPUTS = {
    "unknown dataset": (lambda t: ["--dataset", "imagenet"], "invalid choice"),
    "unknown arch": (lambda t: ["--arch", "resnet19"], "unknown --arch 'resnet19'"),
    "missing image folder": (
        lambda t: ["--dataset", "imagefolder", "--data-dir", t / "none"],
        "not found",
    ),
    "missing cifar, no download": (
        lambda t: ["--dataset", "cifar10", "--data-dir", t, "--no-download"],
        "cifar10 not found",
    ),
    "corrupt checkpoint": (corrupt_checkpoint, "is not a readable checkpoint"),
    "checkpoint of another arch": (
        other_arch_checkpoint,
        "was written with --arch tiny, not --arch resnet18",
    ),
    "unreachable rendezvous": (lambda t: ["--port", free_port(), "--timeout", "3"], "timed out"),
    # found by tools/fuzz_flags.py: PyTorch's own ValueError and KeyError, each a traceback
    "negative momentum": (
        lambda t: ["--momentum", "-1"],
        "--lr, --momentum and --weight-decay must be >= 0",
    ),
    "negative weight decay": (
        lambda t: ["--weight-decay", "-1"],
        "--lr, --momentum and --weight-decay must be >= 0",
    ),
    "a timeout that is no number": (lambda t: ["--timeout", "nan"], "--timeout, --clip-grad"),
    "a port out of range": (
        lambda t: ["--port", "70000"],
        "--port 70000 is not a port: give 1 to 65535",
    ),
    "rendezvous at an unknown url": (
        lambda t: ["--dist-url", "bogus://x"],
        "--dist-url bogus://x: give env://, tcp://HOST:PORT or file:///PATH",
    ),
    "an address of another machine": (
        lambda t: ["--ip", "no.such.host.invalid", "--port", free_port()],
        "; rank 0 listens there: --ip or --dist-url must be its node's address",
    ),
    # found by tools/fuzz_flags.py: init_process_group's device_id error, which named no flag
    "nccl without a GPU": (
        lambda t: ["--backend", "nccl"],
        "--backend nccl needs GPUs, and none is visible: leave it out for gloo",
    ),
    # found by tools/fuzz_flags.py: the mode alone kept nothing, and said nothing
    "a best's mode without what it ranks": (
        lambda t: ["--keep-best-mode", "max"],
        "--keep-best-mode needs --keep-best NAME",
    ),
    "rendezvous at env:// without its address": (
        lambda t: ["--dist-url", "env://"],
        "--dist-url env:// reads MASTER_ADDR and MASTER_PORT, which are not set",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_ends_with_one_clear_line(case, tmp_path):
    make_args, expected = BAD_INPUTS[case]
    if case == "nccl without a GPU" and torch.cuda.is_available():
        pytest.skip("nccl is the default with a GPU")
    env = {"RANK": "1", "WORLD_SIZE": "2"} if "rendezvous" in case else {}
    if "address" in case:  # rank 0 listens on it
        env = {"RANK": "0", "WORLD_SIZE": "2"}
    args = [*TINY, "--output-dir", tmp_path / "default-out", *make_args(tmp_path)]
    result = run(python("distributed.py", *args), timeout=60, env=env, check=False)
    assert result.returncode != 0
    assert "Traceback" not in result.stdout + result.stderr
    assert "frame #" not in result.stderr  # no C++ stack dump
    last_line = result.stderr.strip().splitlines()[-1]
    assert expected in last_line, result.stderr


def test_port_in_use_names_the_port(tmp_path):
    with occupied_port() as s:
        port = s.getsockname()[1]
        result = run(
            python("distributed.py", *TINY, "--port", port, "--output-dir", tmp_path),
            timeout=60,
            check=False,
        )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: cannot listen on tcp://127.0.0.1:{port}: the port is in use; choose another --port"
    )


def test_an_error_line_is_one_write_so_that_ranks_lines_never_run_together():
    """Ranks failing at once write into one stderr (torchrun's): a line in two writes (print() writes its newline
    apart, at once with PYTHONUNBUFFERED) ran into the other rank's line. Each write shows here as <...>."""
    code = (
        "import io, os, sys\n"
        "import utils\n"
        "class Writes(io.RawIOBase):\n"
        "    def writable(self): return True\n"
        "    def write(self, data): return os.write(2, b'<' + bytes(data) + b'>') and len(data)\n"
        "sys.stderr = io.TextIOWrapper(Writes(), write_through=True)\n"
        "utils.run_main(lambda teardown: utils.build_parser('').parse_args(['--no-such-flag']))\n"
    )
    result = run([PYTHON, "-c", code], timeout=60, check=False)
    assert result.returncode == 1 and result.stderr == (
        "<error: unrecognized arguments: --no-such-flag (see -c --help)\n>"
    ), result.stderr


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("gpu-07", "gpu-07"),
        ("node[01-04]", "node01"),
        ("node[3,5-7],login1", "node3"),
        ("a1,a2", "a1"),
        ("rack2-[100-101]", "rack2-100"),
    ],
)
def test_slurm_node_lists_give_their_first_host(nodelist, first):
    assert slurm.slurm_master_addr(nodelist) == first


def test_an_older_pytorch_is_named_in_one_line_by_every_script(tmp_path):
    """requirements.txt asks for 2.8: before it, a gloo process group could hang at exit (seen on 2.4.1 in about one
    2-process run in 10) and the tcp:// store refused its listening socket. Here an older one is stood in for."""
    (tmp_path / "sitecustomize.py").write_text("import torch\ntorch.__version__ = '2.7.1+cu126'\n")
    scripts = [
        "dataparallel.py",
        "distributed.py",
        "distributed_mp.py",
        "distributed_amp.py",
        "distributed_grad_accum.py",
        "distributed_fsdp.py",
    ]
    results = run_parallel(
        [
            (python(script, *TINY, "--output-dir", tmp_path / "out"), {"PYTHONPATH": str(tmp_path)})
            for script in scripts
        ],
        timeout=60,
        check=False,
    )
    for script, result in zip(scripts, results):
        assert result.returncode == 1 and result.stderr == (
            "error: the scripts need PyTorch 2.8 or newer, not 2.7.1+cu126: pip install -r requirements.txt\n"
        ), script


def test_a_commands_own_pythonpath_is_read_as_a_fresh_interpreter_reads_it(tmp_path):
    """The tests start a command warm also with a PYTHONPATH of its own (tools/warm_ranks.py): a sitecustomize.py
    there runs before the script, as Python's site runs it; a folder that stands in for a package the warm server
    has imported (numpy) starts the command as a fresh interpreter, whose import finds the stand-in."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text("import os\nos.environ['SITE_RAN'] = '1'\n")
    (tmp_path / "stand_in" / "numpy").mkdir(parents=True)
    (tmp_path / "stand_in" / "numpy" / "__init__.py").write_text("STAND_IN = True\n")
    script = tmp_path / "which.py"
    script.write_text(
        "import os\nimport sys\n\nwarm = 'torch' in sys.modules\nimport numpy\n\n"
        "print(warm, os.environ.get('SITE_RAN'), getattr(numpy, 'STAND_IN', False))\n"
    )
    site, stand_in = run_parallel(
        [
            (python(script), {"PYTHONPATH": str(tmp_path / folder)})
            for folder in ("site", "stand_in")
        ],
        timeout=60,
    )
    # forked from the warm server (torch already imported), unless DDP_TESTS_COLD starts everything afresh
    assert site.stdout == f"{processes.WARM} 1 False\n" and stand_in.stdout == "False None True\n"


def readme_line(ends: str) -> list[str]:
    """The words of the README's command line that ends with ends (its comment too), its comment cut."""
    line = next(
        line.split("  #")[0]
        for line in (ROOT / "README.md").read_text().splitlines()
        if line.startswith("    ") and line.rstrip().endswith(ends)
    )
    return shlex.split(line)


def test_the_readme_one_process_and_curves_lines_run_as_written(tmp_path):
    """The README's one-process line (Launching) and its line that records the main job, whose curves.svg it shows,
    as written but for their output paths, run at once: the one process learns (ten classes: chance is 0.1) in
    about a quarter of a minute on 2 CPU cores; the recorded run writes a record every 2 steps and a validation
    every 4, TensorBoard's events, learns, and its picture, curves.svg, draws every record."""
    one = readme_line("# one process")
    recorded = readme_line("--tensorboard --output-dir output")
    assert one[:2] == ["python", "distributed.py"] and recorded[0] == "torchrun", (one, recorded)
    out = tmp_path / "recorded"
    run_parallel(
        [
            ([PYTHON, *one[1:], "--output-dir", tmp_path / "one"], {}),
            ([PYTHON, "-m", "torch.distributed.run", *recorded[1:-1], out], {}),
        ],
        timeout=300,
    )
    assert metrics(tmp_path / "one")[-1]["val_acc"] >= 0.9, metrics(tmp_path / "one")
    trained = [r["global_step"] for r in steps(out) if "train_loss" in r]
    validated = [r["global_step"] for r in steps(out) if "val_loss" in r]
    assert trained == list(range(2, 49, 2)) and validated == list(range(4, 49, 4)), (
        trained,
        validated,
    )
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert metrics(out)[-1]["val_acc"] >= 0.9, metrics(out)
    drawn = {
        line.get("data-series"): len(line.get("points").split())
        for line in ET.parse(out / "curves.svg")
        .getroot()
        .iter("{http://www.w3.org/2000/svg}polyline")
    }
    assert drawn == {"train_loss": 24, "val_loss": 12, "val_acc": 12, "lr": 24, "images_per_s": 24}
