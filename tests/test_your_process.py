"""What a user's program keeps: importing the core (utils.py) or an extra changes nothing of the process (no
environment variable, no warnings filter), and a run ends as a Python program does, so that the user's atexit
handlers and finally blocks run on every rank, after a run and after an error."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

from processes import PYTHON, ROOT, TINY, run, torchrun
from projects import copy_core


def libraries_imported(path: Path) -> set[str]:
    """The modules path imports that are neither ours (the core, an extra) nor relative: a library's."""
    tree = ast.parse(path.read_text())
    names = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    names |= {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 0
    }
    return {name for name in names if name.split(".")[0] not in ("utils", "extras", "__future__")}


def test_importing_the_core_or_an_extra_changes_nothing_of_the_process():
    """The libraries they import are imported first (what those do is theirs); then the core and every extra: the
    environment and the warnings filters are as they were."""
    extras = sorted(path.stem for path in (ROOT / "extras").glob("*.py") if path.stem != "__init__")
    libraries = set()
    for path in [ROOT / "utils.py", *(ROOT / "extras").glob("*.py")]:
        libraries |= libraries_imported(path)
    code = (
        "import importlib, os, sys, warnings\n"
        f"for name in {sorted(libraries)!r}:\n"
        "    importlib.import_module(name)\n"
        "environment, filters = dict(os.environ), list(warnings.filters)\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "import utils\n"
        f"for name in {extras!r}:\n"
        "    importlib.import_module('extras.' + name)\n"
        "changed = {k for k in {*environment, *os.environ} if environment.get(k) != os.environ.get(k)}\n"
        "assert not changed, changed\n"
        "assert warnings.filters == filters, [f for f in warnings.filters if f not in filters]\n"
        "print('unchanged')\n"
    )
    result = subprocess.run(
        [PYTHON, "-c", code], capture_output=True, text=True, timeout=300, cwd="/"
    )
    assert result.returncode == 0 and result.stdout.strip() == "unchanged", result.stderr


# a user's atexit handler, registered as their module is imported, and a finally block around the run
YOUR_ENDS = """
import atexit


def note_end(what: str) -> None:
    Path(os.environ["ENDS"], f"{what}-rank{os.environ.get('RANK', '0')}").touch()


atexit.register(note_end, "atexit")

if __name__ == "__main__":
    try:
        utils.run_main(main)
    finally:
        note_end("finally")
"""


@pytest.mark.real_launch  # as a fresh interpreter ends
def test_your_atexit_handlers_and_finally_blocks_run_on_every_rank(tmp_path):
    """distributed.py with the user's atexit handler and a finally block around run_main, on 2 processes: both run on
    both ranks at the end of a run (exit status 0) and of one that a user's mistake ended (exit status 1, its line)."""
    copy_core(ROOT, tmp_path)
    source = (ROOT / "distributed.py").read_text()
    ending = '\nif __name__ == "__main__":\n    utils.run_main(main)\n'
    assert source.endswith(ending)
    script = tmp_path / "distributed.py"
    script.write_text(source.removesuffix(ending) + "\n" + YOUR_ENDS)
    for case, flags in (("trained", []), ("refused", ["--batch-size", "1"])):
        ends = tmp_path / case
        ends.mkdir()
        command = torchrun(
            2, str(script), *TINY, "--epochs", "1", "--output-dir", tmp_path / f"out-{case}"
        )
        result = run([*command, *flags], env={"ENDS": str(ends)}, check=False, cwd=tmp_path)
        assert result.returncode == (0 if case == "trained" else 1), result.stderr
        if case == "refused":
            assert "error: --batch-size 1 is smaller than 2 processes" in result.stderr, (
                result.stderr
            )
        expected = {f"{what}-rank{rank}" for what in ("atexit", "finally") for rank in (0, 1)}
        assert {path.name for path in ends.iterdir()} == expected, (case, result.stderr)
