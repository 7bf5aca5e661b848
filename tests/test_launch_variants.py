"""dataparallel.py and distributed_mp.py train the same model as distributed.py."""

from __future__ import annotations

import socket

import pytest

from processes import (
    EVAL_EVERY,
    TINY,
    assert_same_records,
    free_port,
    max_weight_difference,
    metrics,
    python,
    run,
    run_parallel,
    steps,
    torchrun,
)

# the launch itself is under test: every script starts as users start it
pytestmark = pytest.mark.real_launch


def test_dataparallel_equals_single_process_ddp(tmp_path, reference):
    out = tmp_path / "dp"
    result = run(python("dataparallel.py", *TINY, "--no-augment", *EVAL_EVERY, "--output-dir", out))
    if "no GPU visible" in result.stdout:  # CPU here and in CI; on a GPU machine DP really splits
        assert "training on the CPU" in result.stdout
    assert max_weight_difference(out, reference["one"]) <= 1e-5
    assert [m["world_size"] for m in metrics(out)] == [1, 1, 1]
    assert metrics(out)[-1]["val_acc"] > 0.6
    assert_same_records(steps(out), steps(reference["one"]), tolerance=1e-5)


def test_spawn_equals_torchrun(tmp_path, reference):
    out = tmp_path / "mp"
    run(
        python(
            "distributed_mp.py",
            *TINY,
            "--no-augment",
            *EVAL_EVERY,
            "--nproc",
            "2",
            "--output-dir",
            out,
        )
    )
    assert [m["world_size"] for m in metrics(out)] == [2, 2, 2]
    assert max_weight_difference(out, reference["two"]) <= 1e-5
    assert_same_records(steps(out), steps(reference["two"]), tolerance=1e-5)


def test_spawn_on_two_nodes_forms_one_world(tmp_path, reference):
    out, port = tmp_path / "mp", free_port()
    node = [
        *TINY,
        "--no-augment",
        "--nodes",
        "2",
        "--nproc",
        "1",
        "--ip",
        "127.0.0.1",
        "--port",
        port,
        "--output-dir",
        out,
    ]
    run_parallel([(python("distributed_mp.py", *node, "--node-rank", str(i)), {}) for i in (0, 1)])
    assert [m["world_size"] for m in metrics(out)] == [2, 2, 2]
    assert max_weight_difference(out, reference["two"]) <= 1e-5


def last_error_line(args: list) -> str:
    result = run(python("distributed_mp.py", *TINY, *args), timeout=60, check=False)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr.strip().splitlines()[-1]


def test_spawn_reports_a_child_error_in_one_line(tmp_path):
    assert last_error_line(["--nproc", "2", "--batch-size", "1", "--output-dir", tmp_path]) == (
        "error: --batch-size 1 is smaller than 2 processes: give each at least one sample"
    )


def test_spawn_names_a_port_in_use(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = last_error_line(["--nproc", "2", "--port", port, "--output-dir", tmp_path])
    assert (
        line
        == f"error: cannot listen on tcp://127.0.0.1:{port}: the port is in use; choose another --port"
    )


def test_spawn_multi_node_needs_an_address(tmp_path):
    assert "--nodes > 1 needs --ip and --port" in last_error_line(
        ["--nodes", "2", "--output-dir", tmp_path]
    )


def test_torchruns_summary_of_failed_processes_names_the_cause(tmp_path):
    """A flag no script has, under torchrun (real torchrun, not the tests' warm ranks): the line is said once;
    torchrun's own summary after it (its ChildFailedError box) names the cause as the root cause's traceback entry,
    from the error file a rank writes, instead of a link to its docs. (A rank still starting when the first fails is
    ended by torchrun, its entry a signal's.)"""
    result = run(
        torchrun(2, "distributed.py", "--no-such-flag", "--output-dir", tmp_path / "out"),
        check=False,
    )
    line = "unrecognized arguments: --no-such-flag (see distributed.py --help)"
    said = [text for text in result.stderr.splitlines() if text == f"error: {line}"]
    assert result.returncode != 0 and len(said) == 1, result.stderr
    root_cause = result.stderr.split("Root Cause", 1)[1]
    assert f"traceback : {line}" in root_cause, result.stderr
