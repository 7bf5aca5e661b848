"""Draw a run's steps.jsonl as an SVG: training and validation loss (log scale) and validation accuracy against the
optimizer step; or, with --phases, where a step's time went on each rank, a bar a rank, from the last training
record (or the epoch line of a metrics.jsonl). No plotting package needed; TensorBoard shows the curves live.

    python tests/plot_records.py output/steps.jsonl --out docs/curves.svg --title "what ran"
    python tests/plot_records.py output/steps.jsonl --phases --out docs/phases.svg --title "what ran"
"""

from __future__ import annotations

import argparse
import json
import math
from html import escape
from pathlib import Path

WIDTH, PANEL, LEFT, TOP = (
    720,
    220,
    70,
    40,
)  # pixels: the picture, one panel's height, the axis margins
SERIES = {"train_loss": "#1f77b4", "val_loss": "#d62728", "val_acc": "#2ca02c"}
PHASE_COLOURS = ["#8c564b", "#1f77b4", "#ff7f0e", "#bbbbbb", "#2ca02c", "#9467bd"]  # data ... outer
BAR = 26  # pixels: a rank's bar


def read(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Each series' (global step, value) points, from the records that carry it."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {
        key: [(r["global_step"], r[key]) for r in records if r.get(key) is not None]
        for key in SERIES
    }


def panel(
    points: dict[str, list[tuple[int, float]]],
    top: int,
    last_step: int,
    log_scale: bool,
    label: str,
) -> list:
    """One panel's axes, grid lines and polylines, as SVG elements."""
    values = [v for series in points.values() for _, v in series]
    scale = (lambda v: math.log10(v)) if log_scale else (lambda v: v)  # noqa: E731
    low, high = (
        (math.floor(scale(min(values))), math.ceil(scale(max(values)))) if log_scale else (0.0, 1.0)
    )
    x = lambda step: LEFT + (WIDTH - LEFT - 20) * step / last_step  # noqa: E731
    y = lambda v: top + PANEL - PANEL * (scale(v) - low) / (high - low or 1)  # noqa: E731
    ticks = [10.0**e for e in range(low, high + 1)] if log_scale else [0.0, 0.25, 0.5, 0.75, 1.0]
    out = [f'<text x="{LEFT}" y="{top - 8}" font-size="13">{escape(label)}</text>']
    for tick in ticks:
        out.append(
            f'<line x1="{LEFT}" x2="{WIDTH - 20}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" stroke="#ddd"/>'
            f'<text x="{LEFT - 6}" y="{y(tick) + 4:.1f}" font-size="11" text-anchor="end">{tick:g}</text>'
        )
    for key, series in points.items():
        line = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in series)
        out.append(
            f'<polyline points="{line}" fill="none" stroke="{SERIES[key]}" stroke-width="2"/>'
        )
    return out


def svg(points: dict[str, list[tuple[int, float]]], title: str) -> str:
    last_step = max(s for series in points.values() for s, _ in series)
    losses = {k: v for k, v in points.items() if k.endswith("loss") and v}
    height = TOP + 2 * PANEL + 110
    body = panel(losses, TOP + 20, last_step, True, "loss per item (log scale)")
    if points["val_acc"]:
        body += panel(
            {"val_acc": points["val_acc"]},
            TOP + PANEL + 70,
            last_step,
            False,
            "validation accuracy",
        )
    legend = [
        f'<text x="{WIDTH - 20 - 130 * (len(SERIES) - i)}" y="{height - 12}" font-size="12" '
        f'fill="{colour}">&#9644; {key}</text>'
        for i, (key, colour) in enumerate(SERIES.items())
    ]
    axis = (
        f'<text x="{LEFT}" y="{height - 12}" font-size="12">optimizer step (global_step), 0 to {last_step}'
        f"</text>"
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="sans-serif">'
        f'<rect width="100%" height="100%" fill="white"/><text x="{LEFT}" y="20" font-size="14">'
        f"{escape(title)}</text>" + "".join(body + legend) + axis + "</svg>\n"
    )


def phases_svg(record: dict, title: str) -> str:
    """A record's phases, ms a step: a stacked bar a rank, the phases in a step's order; the slow rank named."""
    phases = record["phase_ms"]
    ranks = len(next(iter(phases.values())))
    longest = max(sum(times[rank] for times in phases.values()) for rank in range(ranks))
    scale = (WIDTH - LEFT - 20) / longest
    height = TOP + 30 + ranks * (BAR + 8) + 50
    body = []
    for rank in range(ranks):
        y, x = TOP + 30 + rank * (BAR + 8), LEFT
        body.append(
            f'<text x="{LEFT - 6}" y="{y + BAR - 8}" font-size="12" text-anchor="end">rank {rank}</text>'
        )
        for (name, times), colour in zip(phases.items(), PHASE_COLOURS):
            width = times[rank] * scale
            body.append(
                f'<rect x="{x:.1f}" y="{y}" width="{width:.1f}" height="{BAR}" fill="{colour}">'
                f"<title>{escape(name)} {times[rank]:.2f} ms</title></rect>"
            )
            x += width
    slow = record.get("slow")
    said = f"rank {slow['rank']} slow: {slow['phase']}" if slow else "no rank slow"
    legend = [
        f'<text x="{LEFT + 110 * i}" y="{height - 12}" font-size="12" fill="{colour}">&#9644; {escape(name)}</text>'
        for i, (name, colour) in enumerate(zip(phases, PHASE_COLOURS))
    ]
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="sans-serif">'
        f'<rect width="100%" height="100%" fill="white"/><text x="{LEFT}" y="20" font-size="14">{escape(title)}'
        f'</text><text x="{LEFT}" y="{TOP + 14}" font-size="12">ms a step, 0 to {longest:.1f}; {said}</text>'
        + "".join(body + legend)
        + "</svg>\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("steps", type=Path, help="a run's steps.jsonl")
    parser.add_argument("--out", type=Path, required=True, help="the SVG to write")
    parser.add_argument("--title", default="", help="a line above the curves: what ran")
    parser.add_argument(
        "--phases", action="store_true", help="instead: each rank's phases in the last record"
    )
    args = parser.parse_args()
    if args.phases:
        records = [json.loads(line) for line in args.steps.read_text().splitlines() if line]
        last = [record for record in records if "phase_ms" in record][-1]
        args.out.write_text(phases_svg(last, args.title))
    else:
        args.out.write_text(svg(read(args.steps), args.title))


if __name__ == "__main__":
    main()
