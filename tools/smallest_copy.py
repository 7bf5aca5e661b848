"""Write the smallest copy of a script that trains a project of your own: the script, utils.py and
the extras its top imports, with the blocks of every extra a run enters unasked deleted, as a user
deletes them (the block, and the comment lines above it), and those extras' files left out:

    python tools/smallest_copy.py distributed.py ../your_project

The blocks deleted: the run's picture (curves, every run), the live line (live, a terminal), MFU's
peaks and DataLoader workers' start (peaks and workers, a GPU), torchrun's agent store (elastic),
and the three extras on by default, the watchdog (stalls), each sample's seeds (seeds) and the
start-up checks (checks): the copy runs with no flag. Every other extra's block stays, with its
file left out: its flag (--phases) ends every rank with one line naming the file to copy beside
the others.
"""

from __future__ import annotations

import argparse
import ast
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the blocks a run enters unasked: by the machine, and the three extras on by default
MACHINE = ("curves", "live", "peaks", "workers", "elastic")
ON_BY_DEFAULT = ("stalls", "seeds", "checks")


def delete_blocks(script: Path, extra: str) -> None:
    """Each if-block of script whose body imports extra, deleted with the comment lines above it,
    as a user deletes it (an else that imports it, a path the block's if does not take, stays)."""
    while True:
        lines = script.read_text().splitlines(keepends=True)
        block = next(
            (
                node
                for node in ast.walk(ast.parse("".join(lines)))
                if isinstance(node, ast.If)
                and any(
                    isinstance(inner, ast.ImportFrom)
                    and inner.module == "extras"
                    and [a.name for a in inner.names] == [extra]
                    for inner in node.body
                )
            ),
            None,
        )
        if block is None:
            return
        first = block.lineno - 1
        while lines[first - 1].strip().startswith("#"):
            first -= 1
        script.write_text("".join(lines[:first] + lines[block.end_lineno :]))


def top_extras(script: Path) -> set[str]:
    """The extras script imports at its top (the ones every run uses)."""
    return {
        alias.name
        for node in ast.parse(script.read_text()).body
        if isinstance(node, ast.ImportFrom) and node.module == "extras"
        for alias in node.names
    }


def shrink(script: Path, deleted: tuple[str, ...] = MACHINE + ON_BY_DEFAULT) -> Path:
    """script, in a folder with utils.py and extras/, made its smallest copy: the blocks of each
    extra named in `deleted` removed, and every extra file its top does not import left out.
    Returns script."""
    for extra in deleted:
        delete_blocks(script, extra)
    # a stream's seeding is the seeds' extra's, named outside its block: none where the block goes
    if "seeds" in deleted:
        source = script.read_text()
        seeded = "seeded=None if args.no_sample_seeds else seeds.sample_streams"
        script.write_text(source.replace(seeded, "seeded=None"))
    kept = top_extras(script) | {"__init__"}
    for path in (script.parent / "extras").glob("*.py"):
        if path.stem not in kept:
            path.unlink()
    return script


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Write the smallest copy of a script that trains a project of your own."
    )
    parser.add_argument("script", help="the script to copy, e.g. distributed.py")
    parser.add_argument("destination", type=Path, help="the folder to write it into (made)")
    args = parser.parse_args()
    source = ROOT / Path(args.script).name
    if not source.exists() or source.name == "utils.py":
        parser.error(f"{args.script}: not one of the scripts in {ROOT}")
    # nothing of the folder's own is written over (a project's own utils.py: README.md's rename)
    destination = args.destination
    there = [name for name in (source.name, "utils.py", "extras") if (destination / name).exists()]
    if there:
        parser.error(f"{destination} holds {', '.join(there)} already: choose a new folder")
    (destination / "extras").mkdir(parents=True)
    shutil.copy(source, destination)
    shutil.copy(ROOT / "utils.py", destination)
    for path in (ROOT / "extras").glob("*.py"):
        shutil.copy(path, destination / "extras")
    shrink(destination / source.name)
    extras = sorted(f"extras/{path.name}" for path in (destination / "extras").glob("*.py"))
    written = [source.name, "utils.py", *extras]
    print(
        f"wrote {', '.join(written)} into {destination}: replace the four plug points at the top of"
        f" {source.name} with yours (its own read the demo data of extras/builtin.py, left out)"
    )


if __name__ == "__main__":
    main()
