"""The README and docs/ stay true: links and images resolve, the tests they name exist, and every script and flag
that their commands name exists (the script's --help lists the flag)."""

from __future__ import annotations

import ast
import json
import re
import shlex
from pathlib import Path

import pytest

from processes import PYTHON, ROOT, run_parallel

PAGES = [ROOT / "README.md", ROOT / "tools" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def code_lines(page: Path) -> list[str]:
    """The lines of a page's code: indented blocks, fenced blocks, and inline commands (`python ...`)."""
    lines, fenced = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith("    "):
            lines.append(line.strip())
    text = page.read_text().replace("\n", " ")
    return lines + re.findall(r"`((?:python|torchrun|srun) [^`]+)`", text)


def commands(page: Path) -> list[tuple[str, list[str]]]:
    """(script, its flags) of each command line that runs one of our scripts."""
    found = []
    for line in code_lines(page):
        line = line.split(" #")[0].replace(
            "$SCRATCH", "scratch"
        )  # comments; a shell variable shlex keeps
        words = (
            shlex.split(line.split("&&")[-1])
            if not line.startswith(("#", "def ", "return "))
            else []
        )
        script = next((w for w in words if w.endswith(".py") and (ROOT / w).is_file()), None)
        if script:
            flags = [
                w.split("=")[0].replace("_", "-")
                for w in words[words.index(script) + 1 :]
                if w.startswith("--")
            ]
            found.append((script, flags))
    return found


def help_texts(scripts: set[str]) -> dict[str, str]:
    """Each script's --help, all started at once: importing torch, in turn, would be most of this test's time."""
    results = run_parallel(
        [([PYTHON, script, "--help"], {}) for script in sorted(scripts)], timeout=120
    )
    return dict(zip(sorted(scripts), (result.stdout for result in results)))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_and_images_resolve(page):
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    local = [t for t in targets if not re.match(r"[a-z]+://", t)]
    missing = [t for t in local if not (page.parent / t).exists()]
    assert not missing, f"{page.name}: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_tests_named_exist(page):
    named = re.findall(r"(tests/[\w/]+\.py)::(\w+)", page.read_text())
    for path, name in named:
        functions = {
            node.name
            for node in ast.parse((ROOT / path).read_text()).body
            if isinstance(node, ast.FunctionDef)
        }
        assert name in functions, f"{page.name} names {path}::{name}, which does not exist"


def test_every_script_and_flag_in_the_commands_exists():
    named = [(page.name, script, flags) for page in PAGES for script, flags in commands(page)]
    assert len(named) >= 20 and {"distributed.py", "distributed_fsdp.py", "tools/benchmark.py"} <= {
        script for _, script, _ in named
    }  # the parser finds the commands
    helps = help_texts({script for _, script, _ in named})
    for page, script, flags in named:
        unknown = [f for f in flags if not re.search(rf"{re.escape(f)}\b", helps[script])]
        assert not unknown, f"{page}: {script} has no {unknown}"


def test_each_tool_has_its_paragraph_and_its_help_and_tests_holds_tests():
    """tools/ holds what a user runs by hand and what those share with the tests, each file named in tools/README.md
    (the README's section points there); each tool that takes flags lists them with --help. tests/ holds the tests
    and what they alone run: each other file there is named by a test, and by no page."""
    tools = sorted(path for path in (ROOT / "tools").glob("*.py"))
    paragraphs = (ROOT / "tools" / "README.md").read_text()
    assert len(tools) >= 20 and not [p.name for p in tools if p.name not in paragraphs]
    assert "tools/README.md" in (ROOT / "README.md").read_text()
    programs = {f"tools/{path.name}" for path in tools if "argparse" in path.read_text()}
    assert {
        "tools/benchmark.py",
        "tools/gpu_check.py",
        "tools/chaos.py",
        "tools/fuzz_flags.py",
    } <= programs
    assert {"tools/network_benchmark.py", "tools/plot_records.py"} <= programs
    for tool, text in help_texts(programs).items():
        assert text.startswith("usage: ") and "--help" in text, (tool, text[-500:])
    tests = ROOT / "tests"
    helpers = [
        path
        for path in tests.rglob("*.py")
        if not path.name.startswith("test_") and path.name != "conftest.py"
    ]
    named_by_tests = "".join(path.read_text() for path in tests.glob("*.py") if path not in helpers)
    assert helpers and all(path.stem in named_by_tests for path in helpers), helpers
    run_by_pages = {script for page in PAGES for script, _ in commands(page)}
    assert not [script for script in run_by_pages if script.startswith("tests/")], run_by_pages


def test_the_readme_is_a_map_whose_test_command_is_what_ci_runs():
    """The README stays a map (220 lines at most); .ci/run runs exactly its test command."""
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) <= 220, len(readme)
    command = next(
        line.strip()
        for line in readme
        if line.strip().startswith("python -m pip install") and "pytest" in line
    )
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == command and "ruff check ." in command and "ruff format --check ." in command, (
        ci,
        command,
    )


# Each command line the README shows, by a part of it: the test that runs it as written (but for its output
# paths), or why none can run here
README_RUN = {
    "pip install -r requirements.txt && torchrun": "tests/test_distributed.py::test_the_readme_main_job_learns_from_the_files_a_user_copies",
    "pip install -r requirements.txt -r tests/requirements.txt": "tests/test_docs.py::test_the_readme_is_a_map_whose_test_command_is_what_ci_runs",
    "cp utils.py your_project/ddp_utils.py": "tests/test_distributed.py::test_the_readme_main_job_learns_from_the_files_a_user_copies",
    "sed -i -E": "tests/test_distributed.py::test_the_readme_main_job_learns_from_the_files_a_user_copies",
    "--epochs 3   # one process": "tests/test_distributed.py::test_the_readme_one_process_and_curves_lines_run_as_written",
    "--tensorboard --output-dir output": "tests/test_distributed.py::test_the_readme_one_process_and_curves_lines_run_as_written",
    "plot_records.py output/steps.jsonl": "tests/test_distributed.py::test_the_readme_one_process_and_curves_lines_run_as_written",
}
README_NOT_RUN = {
    "# all GPUs here": "4 GPUs, and CIFAR-10 downloaded",
    "--nnodes=2 --node_rank=0": "two machines of 8 GPUs",
    "srun python": "Slurm",
    "RANK=0 WORLD_SIZE=2": "a second machine at 10.0.0.1, and CIFAR-10 downloaded",
    "distributed_mp.py --nproc 4": "4 GPUs, and CIFAR-10 downloaded",
    "--max-restarts=3": "4 GPUs, and CIFAR-10 downloaded",
    "--rdzv-endpoint=store:29400": "a store host and machines that join it",
    "distributed_fsdp.py --optimizer adamw --amp-dtype bfloat16": "8 GPUs, and CIFAR-10 downloaded",
    "--data-dir /data/imagenet": "ImageNet and 8 GPUs",
}


def test_every_command_the_readme_shows_is_run_as_written_by_a_test_or_says_why_not():
    """Each command line of the README (its indented blocks) is one entry's: a test that runs it as written exists,
    or it needs what no test has here (GPUs, machines, Slurm, a download)."""
    shown = [
        line
        for line in (ROOT / "README.md").read_text().splitlines()
        if re.match(r"    (python|torchrun|cp|sed|srun|RANK=)", line)
    ]
    assert len(shown) >= 15, shown
    for line in shown:
        entries = [part for part in {**README_RUN, **README_NOT_RUN} if part in line]
        assert len(entries) == 1, (line, entries)
    for named in README_RUN.values():
        path, name = named.split("::")
        functions = {
            node.name
            for node in ast.parse((ROOT / path).read_text()).body
            if isinstance(node, ast.FunctionDef)
        }
        assert name in functions, named


SCRIPTS = sorted(path.name for path in ROOT.glob("*.py") if path.name != "utils.py")
# what each script's parse_args makes of no flags here, on this machine (computed defaults filled in)
PARSED = """
import json, sys
sys.argv = [sys.argv[1]]
args = __import__(sys.argv[0].removesuffix(".py")).parse_args()
print(json.dumps(vars(args), default=str))
"""
# defaults the code computes, as the help says them and as this CPU machine gets them
COMPUTED = {
    "workers": ("0 on a CPU", 0),
    "lr": ("sgd 0.1 x batch-size / 256", 0.1),
    "weight_decay": ("sgd 5e-4", 5e-4),
    "port": ("29500 where --ip is given", None),
}


def flag_helps(text: str) -> dict[str, str]:
    """--help's options, flag name (as its dest) to its help on one line."""
    options = text.split("options:", 1)[1].split("\n\n")[0]
    helps = {}
    for chunk in re.split(r"\n(?=  -)", options.strip("\n")):
        chunk = " ".join(chunk.split())
        name = re.match(r"-+([\w-]+)", chunk)[1].replace("-", "_")
        helps[name] = chunk
    return helps


def test_every_flag_says_its_default_and_its_choices_as_the_code_has_them():
    """Every flag of the seven scripts says its default in its help: argparse's own where the parser holds one, which
    is then the value the script parses; words where the code computes it, checked here for the ones this machine
    computes (workers, lr, weight decay, the port); a one-word default of a flag with choices is one of them; the
    rendezvous flags, which dataparallel.py accepts as every script does, say there that they go unused."""
    helps = help_texts(set(SCRIPTS))
    parsed = run_parallel([([PYTHON, "-c", PARSED, script], {}) for script in SCRIPTS], timeout=120)
    for script, result in zip(SCRIPTS, parsed):
        values = json.loads(result.stdout.strip().splitlines()[-1])
        for name, text in flag_helps(helps[script]).items():
            if name in ("h", "help"):
                continue
            assert "default" in text, (script, text)
            # argparse adds its own where the help states none: never both
            assert text.count("(default: ") <= 1, (script, text)
            stated = re.search(r"\(default: ([^ ()]+)\)$", text)
            choices = re.match(r"\S+ \{([^}]*)\}", text)
            if stated and values.get(name) is not None:
                assert stated[1] == str(values[name]), (script, name, stated[1], values[name])
            if stated and choices:
                assert stated[1] in choices[1].split(",") + ["off", "none"], (script, text)
            if name in COMPUTED:
                words, value = COMPUTED[name]
                assert words in text and values[name] == value, (script, name, text, values[name])
            # DataParallel's one process joins no group: its rendezvous flags say they go unused
            if name in ("ip", "port", "dist_url", "backend"):
                unused = "unused here: one process, no process group" in text
                assert unused == (script == "dataparallel.py"), (script, text)
