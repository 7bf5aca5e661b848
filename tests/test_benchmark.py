"""The benchmark's quick mode runs end to end and prints its table, ratios and chart (speed is not checked)."""

import argparse
import json
import math
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import benchmark

from processes import PYTHON, RunFailed, run


def test_quick_benchmark_prints_the_table_ratios_and_chart(tmp_path):
    svg = tmp_path / "speed.svg"
    # without the stream row of the old scripts (their workers hung once in CI): what they measure is in the README
    result = run(
        [
            PYTHON,
            "tools/benchmark.py",
            "--quick",
            "--repeats",
            "1",
            "--fake-size",
            "512",
            "--epochs",
            "2",
            "--without-before",
            "--chart",
            svg,
        ],
        timeout=600,
        env={"DDP_TESTS_WARM": "1"},  # its runs forked warm: the table is checked, not the speed
    )
    tables, _, phases = result.stdout.partition("Phases, ms a step")
    lines = result.stdout.splitlines()
    rows = [line for line in tables.splitlines() if line.startswith("| ") and "---" not in line]
    # each script's phases in its last epoch, the median rank's and the slowest's (not the textbook loop's)
    phased = [line for line in phases.splitlines() if line.startswith("| ") and "---" not in line]
    assert phased[0].startswith(
        "| approach | data | forward + loss | backward | wait | optimizer |"
    )
    assert len(phased) == 1 + 14, phases
    for row in phased[1:]:
        medians = [float(cell.split()[0]) for cell in row.split("|")[2:7]]
        assert medians[1] > 0 and medians[4] > 0, row  # forward + loss, optimizer
    assert len(rows) == 1 + 15, (
        result.stdout
    )  # header and one row per approach, the textbook loop among them
    for row in rows[1:]:
        seconds, first, images_per_s = (row.split("|")[i] for i in (4, 5, 6))
        assert float(seconds.split()[0]) > 0 and float(first) > 0 and float(images_per_s) > 0, row
        assert row.split("|")[8].strip() == "-", row  # no MFU on a CPU: no known peak
        assert row.startswith("| textbook loop") or float(row.split("|")[10]) > 0, (
            row
        )  # the model state per rank
    assert any(row.startswith("| textbook loop") for row in rows)
    for ratio in (
        "- scaling:",
        "- DDP overhead at world size 1:",
        "- accumulation:",
        "- per-step agreement",
        "- watchdog:",
        "- moving average (--ema): ",
        "- streams: read by the main processes, decoded in collate / in its map = ",
        "- data loading:",
        "- FSDP against DDP, same processes: ",
        "- against the textbook loop: DDP, 2 processes / textbook = ",
    ):
        assert any(line.startswith(ratio) for line in lines), ratio
    assert any(line.startswith("Hardware: ") for line in lines)
    bars = (
        ET.parse(svg).getroot().findall("{http://www.w3.org/2000/svg}rect")[1:]
    )  # the first is the background
    assert (
        len(bars) == 15 and len({bar.get("fill") for bar in bars}) == 3
    )  # ours, the textbook loop, the ceiling


def test_the_language_model_benchmark_prints_every_row_its_ratios_and_chart(tmp_path):
    """--lm --quick, small: every row (the scripts in float32 and bfloat16, DDP and FSDP; the textbook loop, Trainer
    and Accelerate in both) trains GPT-2 from its config and has its tokens/s, TFLOP/s by the field's count, no MFU on
    a CPU, its peak memory and a loss below the untrained model's (the vocabulary's log); the ratios of the scripts'
    fastest row to each peer's; the chart a bar a row, ours in one colour and the peers in another."""
    svg = tmp_path / "lm.svg"
    result = run(
        [
            PYTHON,
            "tools/benchmark.py",
            "--lm",
            "--quick",
            "--repeats",
            "1",
            "--epochs",
            "2",
            "--fake-size",
            "128",
        ]
        + ["--chart", svg],
        timeout=600,
        env={"DDP_TESTS_WARM": "1"},  # its runs forked warm: the table is checked, not the speed
    )
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| ")][
        2:
    ]
    assert [row[0].strip() for row in rows] == [
        name for name, *_ in benchmark.lm_cases(quick=True)
    ], rows
    for row in rows:
        processes, batch, seconds, tokens, tflops, mfu, memory, loss, _ = (
            cell.strip() for cell in row[1:]
        )
        assert (processes, batch, mfu) == ("2", "32", "-") and float(seconds) > 0, row
        assert float(tokens.replace(",", "")) > 0 and float(tflops) > 0 and float(memory) > 0, row
        assert 0 < float(loss) < math.log(512), row  # it learns: below the untrained model's loss
    # the scripts' fastest row against each peer's fastest, in turn
    ratios = [line for line in result.stdout.splitlines() if line.startswith("- distributed")]
    assert len(ratios) == 3, result.stdout
    for line, peer in zip(ratios, ("textbook loop", "Trainer", "Accelerate")):
        theirs, ratio = line.split(" / ")[1].split(" = ")
        assert theirs.startswith(peer) and float(ratio.removesuffix("x tokens/s")) > 0, line
    assert any(line.startswith("Hardware: ") for line in result.stdout.splitlines())
    bars = ET.parse(svg).getroot().findall("{http://www.w3.org/2000/svg}rect")[1:]
    assert len(bars) == len(rows) and len({bar.get("fill") for bar in bars}) == 2


def test_a_peer_that_aborts_at_its_exit_after_its_figures_keeps_its_row(tmp_path, monkeypatch):
    """A language-model peer whose rank aborts at its exit once its figures are written (gloo's teardown under
    Trainer: "terminate called without an active exception") keeps its row, the abort said in one line beside the
    table; a peer that wrote no figures still fails the benchmark."""
    figures = [{"epoch_time_s": 1.0, "samples_per_s": 2.0, "train_loss": 3.0, "peak_mem_mb": 4.0}]

    def aborting(cmd, timeout, env, check):
        out = Path(cmd[cmd.index("--output-dir") + 1])
        if "trainer" in cmd:
            (out / "epochs.json").write_text(json.dumps(figures))
        said = "[rank1]: its figures written\nterminate called without an active exception\n"
        return subprocess.CompletedProcess(cmd, 134, "", said)

    monkeypatch.setattr(benchmark, "run", aborting)
    monkeypatch.setattr(benchmark, "ABORTED", [])
    args = argparse.Namespace(batch_size=8, epochs=2, fake_size=16)
    (tmp_path / "kept").mkdir()
    kept = benchmark.run_lm_case(
        ("Trainer", "trainer", [], "bfloat16"), args, 2, {}, tmp_path / "kept"
    )
    assert kept == figures
    assert benchmark.ABORTED == [
        "trainer exited 134 after its figures (terminate called without an active exception): row kept"
    ]
    (tmp_path / "lost").mkdir()
    with pytest.raises(RunFailed, match="accelerate exited 134"):
        benchmark.run_lm_case(
            ("Accelerate", "accelerate", [], "bfloat16"), args, 2, {}, tmp_path / "lost"
        )
