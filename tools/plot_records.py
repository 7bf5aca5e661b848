"""Draw a run's records as an SVG, as the run draws its own curves.svg (extras/curves.py): the curves
of a steps.jsonl (a run of a version that drew none, or one cut to a part); with --phases, a record's
phases alone, a bar a rank: the last that measured them of a steps.jsonl, or of a metrics.jsonl (the
epoch's line). No plotting package needed; TensorBoard shows the curves live.

    python tools/plot_records.py output/steps.jsonl --out curves.svg
    python tools/plot_records.py output/metrics.jsonl --phases --out phases.svg --title "what ran"
"""

from __future__ import annotations

import argparse
import json
import sys
from html import escape
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from extras import curves  # noqa: E402


def phases_svg(record: dict, title: str) -> str:
    """The record's phases as curves.svg draws them, under a title."""
    bars, bottom = curves.phase_bars(record, curves.TOP + 24)
    head = f'<text x="{curves.LEFT}" y="20" font-size="14">{escape(title)}</text>'
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{curves.WIDTH}" height="{bottom + 12}"'
        f' font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>{head}'
        f"{''.join(bars)}</svg>\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "records", type=Path, help="a run's steps.jsonl (or metrics.jsonl with --phases)"
    )
    parser.add_argument("--out", type=Path, required=True, help="the SVG to write")
    parser.add_argument(
        "--title", default="", help="with --phases, a line above the bars: what ran"
    )
    parser.add_argument(
        "--phases", action="store_true", help="each rank's phases in the last record that has them"
    )
    args = parser.parse_args()
    records = [json.loads(line) for line in args.records.read_text().splitlines() if line.strip()]
    if not args.phases:
        if not all("global_step" in record for record in records):
            sys.exit(
                f"{args.records}: the curves need a steps.jsonl (metrics.jsonl: with --phases)"
            )
        args.out.write_text(curves.svg(records))
        return
    timed = [record for record in records if record.get("phase_ms")]
    if not timed:
        sys.exit(f"{args.records}: no record has phase_ms (a run with --phases writes them)")
    args.out.write_text(phases_svg(timed[-1], args.title))


if __name__ == "__main__":
    main()
