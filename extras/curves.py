"""The run's picture: rank 0 draws steps.jsonl as curves.svg beside it at each validation and each
epoch's end: the training and validation loss, the validation accuracy (or your first metric), the
learning rate and samples/s, against the optimizer step; with --phases, each rank's phases in the
last record that measured them, a bar a rank. A file of a few KB written whole, with no
plotting package; a continued run's steps.jsonl holds the whole run, each step once, and so does
its picture. Open it in a browser, from a cluster's file system too.
"""

from __future__ import annotations

import json
import math
from html import escape
from pathlib import Path

from utils import write_atomically

WIDTH, HEIGHT, LEFT, TOP = 720, 140, 70, 34  # pixels: the picture, a panel, the margins
COLOURS = ["#1f77b4", "#d62728"]
PHASE_COLOURS = ["#8c564b", "#1f77b4", "#ff7f0e", "#bbbbbb", "#2ca02c", "#9467bd"]  # data ... outer


class Curves:
    """A sink of the records (metrics.StepRecords.sinks, rank 0): curves.svg drawn again from
    steps.jsonl at each validation's record and each epoch's line."""

    def __init__(self, steps_path: Path):
        self.steps_path = steps_path
        self.path = steps_path.with_name("curves.svg")

    def log_step(self, values: dict, global_step: int) -> None:
        if "val_loss" in values:
            self.draw()

    def log_epoch(self, record: dict, global_step: int) -> None:
        self.draw()

    def draw(self) -> None:
        lines = self.steps_path.read_text().splitlines()
        write_atomically(self.path, svg([json.loads(line) for line in lines if line]).encode())


def svg(records: list[dict]) -> str:
    """The records' panels, one under the other: each series a polyline of a point a record that
    holds it (data-series names it)."""
    # the validation's accuracy, or the first metric of yours it records (a regression: none)
    scores = [k for r in records for k in r if k.startswith("val_") and not k.endswith("_ema")]
    scores = [k for k in scores if k not in ("val_loss", "val_images")]
    score = "val_acc" if "val_acc" in scores else next(iter(scores), None)
    panels = [
        ("loss", ["train_loss", "val_loss"], True),
        (score or "", [score] if score else [], False),
        ("learning rate", ["lr"], False),
        ("samples/s", ["images_per_s"], False),
    ]
    last = max([r["global_step"] for r in records] or [1]) or 1
    out, top = [], TOP
    for title, keys, log_scale in panels:
        points = {key: series(records, key, log_scale) for key in keys}
        points = {key: found for key, found in points.items() if found}
        if points:
            out += panel(points, top, last, log_scale, title)
            top += HEIGHT + TOP
    timed = [r for r in records if r.get("phase_ms")]
    if timed:
        bars, bottom = phase_bars(timed[-1], top)
        out, top = out + bars, bottom + 12
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{top}"'
        f' font-family="sans-serif">{"".join(out)}</svg>\n'
    )


def series(records: list[dict], key: str, log_scale: bool) -> list[tuple[int, float]]:
    """(global step, value) of each record with a number for key (above 0 on a log scale)."""
    return [
        (r["global_step"], float(r[key]))
        for r in records
        if isinstance(r.get(key), (int, float)) and (r[key] > 0 or not log_scale)
    ]


def panel(points: dict, top: int, last: int, log_scale: bool, title: str) -> list[str]:
    """One panel: its frame, its lowest and highest value, a polyline (and dots, where few) a
    series, and their names."""

    def scaled(value: float) -> float:
        return math.log10(value) if log_scale else value

    values = [scaled(v) for found in points.values() for _, v in found]
    low, high = min(values), max(values)
    if not log_scale:
        low = min(low, 0.0)
    span = (high - low) or 1.0

    def xy(step: int, value: float) -> tuple[float, float]:
        return LEFT + (WIDTH - LEFT - 20) * step / last, top + HEIGHT * (
            high - scaled(value)
        ) / span

    out = [
        f'<text x="{LEFT}" y="{top - 8}" font-size="13">{escape(title)}</text>',
        f'<rect x="{LEFT}" y="{top}" width="{WIDTH - LEFT - 20}" height="{HEIGHT}" fill="none"'
        ' stroke="#ccc"/>',
    ]
    for value, y in ((high, top), (low, top + HEIGHT)):
        shown = 10**value if log_scale else value
        out.append(
            f'<text x="{LEFT - 6}" y="{y + 4}" font-size="11" text-anchor="end">{shown:.3g}</text>'
        )
    for i, ((key, found), colour) in enumerate(zip(points.items(), COLOURS)):
        line = " ".join("{:.1f},{:.1f}".format(*xy(step, value)) for step, value in found)
        out.append(
            f'<polyline data-series="{key}" points="{line}" fill="none" stroke="{colour}"'
            ' stroke-width="1.5"/>'
        )
        if len(found) <= 50:  # a few points (validations) each a dot
            for step, value in found:
                x, y = xy(step, value)
                out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{colour}"/>')
        out.append(
            f'<text x="{WIDTH - 24}" y="{top + 16 + 14 * i}" font-size="11" text-anchor="end"'
            f' fill="{colour}">{escape(key)}</text>'
        )
    return out


def phase_bars(record: dict, top: int) -> tuple[list[str], int]:
    """A record's phases (ms a step): a stacked bar a rank, a rectangle a phase (data-rank and
    data-phase name it) as wide as its time, the phases in a step's order; the slow rank named.
    And the y of the legend, the panel's last line."""
    phases = record["phase_ms"]
    ranks = len(next(iter(phases.values())))
    longest = max(sum(times[rank] for times in phases.values()) for rank in range(ranks)) or 1.0
    scale, bar = (WIDTH - LEFT - 20) / longest, max(3, min(18, 2 * HEIGHT // ranks))
    slow = record.get("slow")
    said = f"rank {slow['rank']} slow: {slow['phase']}" if slow else "no rank slow"
    when = f"step {record['global_step']}" if "global_step" in record else "the epoch"
    title = f"each rank's phases ({when}), ms a step, 0 to {longest:.1f}; {said}"
    out = [f'<text x="{LEFT}" y="{top - 8}" font-size="13">{escape(title)}</text>']
    for rank in range(ranks):
        x, y = LEFT, top + rank * (bar + 2)
        if bar >= 10:
            out.append(
                f'<text x="{LEFT - 6}" y="{y + bar - 3}" font-size="11" text-anchor="end">'
                f"rank {rank}</text>"
            )
        for (name, times), colour in zip(phases.items(), PHASE_COLOURS):
            width = times[rank] * scale
            out.append(
                f'<rect data-rank="{rank}" data-phase="{escape(name)}" x="{x:.2f}" y="{y}"'
                f' width="{width:.2f}" height="{bar}" fill="{colour}"><title>rank {rank}'
                f" {escape(name)} {times[rank]:.2f} ms</title></rect>"
            )
            x += width
    legend = " ".join(
        f'<tspan fill="{colour}">&#9644; {escape(name)}</tspan>'
        for name, colour in zip(phases, PHASE_COLOURS)
    )
    bottom = top + ranks * (bar + 2) + 14
    return [*out, f'<text x="{LEFT}" y="{bottom}" font-size="11">{legend}</text>'], bottom
