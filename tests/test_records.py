"""Watching a long run: steps.jsonl, TensorBoard and Weights & Biases every few steps, unbroken by a crash between two
checkpoints, and one line where the tensorboard or wandb package is missing. (Records of 2 processes equal those of 1 in
test_distributed.py, of accumulated micro-batches in test_techniques.py, of a token loss in test_text_and_lists.py.)"""

from __future__ import annotations

import re

import pytest

from processes import (
    OFFLINE,
    TINY,
    assert_same_records,
    assert_wandb_equals_the_records,
    PYTHON,
    ends_every_rank_with,
    finish,
    max_weight_difference,
    metrics,
    run,
    run_parallel,
    start,
    steps,
    torchrun,
    warm_starts,
)
from projects import COMMON, YOUR_CLASSIFICATION, copy_with_your_functions, launch

KILLED_AT_A_KNOWN_STEP = YOUR_CLASSIFICATION.replace("Blobs(640", "Blobs(2000").replace(
    """def build_model(args, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, num_classes))""",
    """\
import signal


class KilledAt(nn.Sequential):
    \"\"\"Kills its own process (SIGKILL: no chance to save) at the training forward KILL_AT_FORWARD, if set.\"\"\"
    forwards = 0

    def forward(self, x):
        self.forwards += self.training
        if self.forwards == int(os.environ.get("KILL_AT_FORWARD", 0)):
            os.kill(os.getpid(), signal.SIGKILL)  # torchrun then ends the rank's session: W&B's service too
        return super().forward(x)


def build_model(args, num_classes):  # dropout: the checkpoint keeps the random stream it draws from
    return KilledAt(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Dropout(0.5), nn.Linear(32, num_classes))""",
)

# 62 steps an epoch; in epoch 2, a checkpoint at step 25 (global step 87), then training records at 28 and 35 and a
# validation at 30 (global 90, 97, 92); a kill in step 38 (between two checkpoints) or 27 (2 steps after one): what
# followed the checkpoint is written again. W&B offline, as it comes (processes.OFFLINE): its service writes what it
# got every 15 s, and dies with the rank. The moving average of the weights continues exactly too
WATCHED = [
    *COMMON,
    "--save-every",
    "25",
    "--print-freq",
    "7",
    "--eval-every",
    "15",
    "--tensorboard",
    "--wandb",
    "ddp-scripts-tests",
    "--ema",
    "0.5",
]
KILLS = {
    "between": (
        str(1 + 62 + 38),
        [77, 83, 90, 92, 97],
    ),  # the start-up check's forward, epoch 1, epoch 2's
    "after": (str(1 + 62 + 27), [69, 76, 77, 83]),
}  # the last records before the checkpoint (62 + 25 = 87)
CONTINUED_FROM = {
    "between": ["1 of 3 epochs done and 25 steps of the next"],
    "after": ["1 of 3 epochs done and 25 steps of the next", "1 of 3 epochs done"],
}


def tensorboard_scalars(output_dir) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard shows: each tag's (step, value) points, read back as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(
        str(output_dir / "tensorboard"), size_guidance={"scalars": 0}
    )  # keep every point
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def assert_curves_equal_the_records(output_dir) -> None:
    """curves.svg (extras/curves.py) parses as SVG and holds a curve for each of the training loss, the validation
    loss and accuracy, the learning rate and samples/s, with a point for each record of steps.jsonl that has it."""
    import xml.etree.ElementTree as ET

    records = steps(output_dir)
    lines = (
        ET.parse(output_dir / "curves.svg").getroot().iter("{http://www.w3.org/2000/svg}polyline")
    )
    drawn = {line.get("data-series"): len(line.get("points").split()) for line in lines}
    keys = ["train_loss", "val_loss", "val_acc", "lr", "images_per_s"]
    assert drawn == {k: sum(isinstance(r.get(k), (int, float)) for r in records) for k in keys}, (
        drawn
    )


def assert_tensorboard_equals_the_records(output_dir) -> None:
    records, scalars = steps(output_dir), tensorboard_scalars(output_dir)
    # the numbers (not the phase table or the slow rank); the position is the points' step
    expected = {
        key
        for record in records
        for key, value in record.items()
        if isinstance(value, (int, float))
    } - {"epoch", "step", "global_step"}
    assert scalars.keys() == expected
    for tag, points in scalars.items():
        wanted = [(r["global_step"], r[tag]) for r in records if r.get(tag) is not None]
        assert [step for step, _ in points] == [step for step, _ in wanted], (
            tag
        )  # none twice, none missing
        assert [value for _, value in points] == pytest.approx(
            [value for _, value in wanted], rel=1e-6
        ), tag


# torchrun's word on a killed worker is part of what it checks
@pytest.mark.real_launch
def test_a_run_killed_between_checkpoints_continues_its_records_exactly(tmp_path):
    """2 processes with dropout, killed by SIGKILL between two --save-every checkpoints, or 2 steps after one (whose
    write, in the background, may not have ended: then the one before), and continued by the same command: the
    records after the checkpoint are written again, once; the first record after
    it, which spans it, equals the straight run's too (the checkpoint keeps its sums); TensorBoard purges what the
    continued run rewrites; W&B, which lost what it got last before the kill, holds every record of the run, and so
    does the run's picture, curves.svg."""
    copy = copy_with_your_functions("distributed.py", tmp_path / "copy", KILLED_AT_A_KNOWN_STEP)
    runs = {
        name: (
            launch(copy, 2, *WATCHED, "--output-dir", tmp_path / name),
            {**OFFLINE, "KILL_AT_FORWARD": kill},
            tmp_path,
        )
        for name, (kill, _) in KILLS.items()
    }
    with warm_starts():  # torchrun's word is checked on the killed runs alone
        straight = start(
            launch(copy, 2, *WATCHED, "--output-dir", tmp_path / "straight"), OFFLINE, tmp_path
        )
    killed = run_parallel(list(runs.values()), check=False)
    straight = finish(*straight, timeout=180)
    assert straight.returncode == 0, straight.stderr
    for (name, (_, last_records)), result in zip(KILLS.items(), killed):
        assert result.returncode != 0 and "Signal 9 (SIGKILL) received" in result.stderr, (
            result.stderr
        )
        assert [r["global_step"] for r in steps(tmp_path / name)][
            -len(last_records) :
        ] == last_records
    with warm_starts():
        continued = run_parallel(
            [
                (launch(copy, 2, *WATCHED, "--output-dir", tmp_path / name), OFFLINE, tmp_path)
                for name in KILLS
            ]
        )
    for name, result in zip(KILLS, continued):
        out = tmp_path / name
        # from the checkpoint of step 25; 2 steps after it, the one before where its write (in the background) was
        # not done yet on a loaded machine: the records after either are written again alike
        done = re.search(
            r"continuing from .*: (1 of 3 epochs done(?: and \d+ steps of the next)?)\n",
            result.stdout,
        )
        assert done and done[1] in CONTINUED_FROM[name], result.stdout
        assert_same_records(steps(out), steps(tmp_path / "straight"), tolerance=1e-6)
        assert max_weight_difference(out, tmp_path / "straight") <= 1e-6
        assert metrics(out)[-1]["val_acc"] > 0.9 and metrics(out)[-1]["val_acc_ema"] > 0.9
        assert_tensorboard_equals_the_records(out)
        assert (
            len(list((out / "tensorboard").iterdir())) == 2
        )  # one event file a run; the reader purges the first's
        assert_curves_equal_the_records(out)  # the whole run, each step once
        assert_wandb_equals_the_records(
            out, runs=2
        )  # the same run, continued: every record, in order
    assert_tensorboard_equals_the_records(tmp_path / "straight")
    assert_wandb_equals_the_records(tmp_path / "straight", runs=1)
    assert_curves_equal_the_records(tmp_path / "straight")


@pytest.mark.parametrize("package", ["tensorboard", "wandb"])
def test_a_tracker_without_its_package_ends_every_rank_with_one_line(package, tmp_path):
    """Asked for --tensorboard or --wandb without the package: one line before any data or model is built, on every
    rank."""
    missing = (
        tmp_path / "site" / package
    )  # on the path first: `import PACKAGE` fails as if not installed
    missing.mkdir(parents=True)
    (missing / "__init__.py").write_text(
        f"raise ModuleNotFoundError(\"No module named '{package}'\")\n"
    )
    flag = ["--tensorboard"] if package == "tensorboard" else ["--wandb", "ddp-scripts-tests"]
    result = run(
        torchrun(2, "distributed.py", *TINY, *flag, "--output-dir", tmp_path / "out"),
        env={"PYTHONPATH": str(missing.parent), **OFFLINE},
        timeout=60,
        check=False,
    )
    line = f"error: --{package} needs the {package} package: pip install {package}"
    # before the rendezvous no rank can wait for another: torchrun stops the other worker once one has failed,
    # which may be before that one's own check (seen in about half the runs)
    assert result.returncode != 0 and result.stderr.count(line) >= 1, result.stderr
    assert "world size" not in result.stdout and not (tmp_path / "out" / package).exists()


def test_wandb_without_a_login_ends_every_rank_with_one_line(tmp_path):
    """--wandb online with no API key (no ~/.netrc in this HOME): wandb's error, as one line on every rank."""
    env = {
        "HOME": str(tmp_path),
        "WANDB_MODE": "online",
        "WANDB_API_KEY": "",
        "WANDB_SILENT": "true",
    }
    result = run(
        torchrun(
            2,
            "distributed.py",
            *TINY,
            "--epochs",
            "1",
            "--wandb",
            "ddp-scripts-tests",
            "--output-dir",
            tmp_path / "out",
        ),
        env=env,
        timeout=60,
        check=False,
    )
    ends_every_rank_with(result, "error: --wandb cannot start its run (No API key configured.")


def test_the_records_plot_as_the_runs_own_curves(reference, tmp_path):
    """tools/plot_records.py draws a steps.jsonl as the run drew its own curves.svg, byte for byte: the run's
    picture and the tool's are one drawing (extras/curves.py), a curve a series, every record a point."""
    assert_curves_equal_the_records(reference["two"])
    run(
        [
            PYTHON,
            "tools/plot_records.py",
            reference["two"] / "steps.jsonl",
            "--out",
            tmp_path / "c.svg",
        ]
    )
    assert (tmp_path / "c.svg").read_bytes() == (reference["two"] / "curves.svg").read_bytes()
    # without an accuracy (a regression), the first metric of the user's, or none: never an empty panel
    import xml.etree.ElementTree as ET

    from extras import curves

    records = [
        {"global_step": 1, "train_loss": 1.0},
        {"global_step": 2, "val_loss": 0.5, "val_images": 9},
    ]
    for extra, series in (({"val_f1": 0.7, "val_f1_ema": 0.6}, ["val_f1"]), ({}, [])):
        root = ET.fromstring(curves.svg([records[0], {**records[1], **extra}]))
        drawn = [
            line.get("data-series") for line in root.iter("{http://www.w3.org/2000/svg}polyline")
        ]
        assert drawn == ["train_loss", "val_loss", *series], drawn
        frames = list(root.iter("{http://www.w3.org/2000/svg}rect"))
        assert len(frames) == 1 + len(series)  # a frame a panel
    # a metrics.jsonl holds epochs, not steps: the curves say so in one line
    failed = run(
        [
            PYTHON,
            "tools/plot_records.py",
            reference["two"] / "metrics.jsonl",
            "--out",
            tmp_path / "m.svg",
        ],
        check=False,
    )
    assert failed.returncode == 1 and failed.stderr.strip().endswith(
        "(metrics.jsonl: with --phases)"
    )
