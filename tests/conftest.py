"""Fixtures shared by the tests; the helpers that run the scripts live in processes.py."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

import processes
import warm_ranks
from processes import (
    EVAL_EVERY,
    LONG,
    ROOT,
    STARTED,
    TINY,
    kill_everything_started_by,
    python,
    run,
    run_parallel,
    torchrun,
    warm_starts,
)

sys.path.insert(0, str(ROOT))  # tests that call utils' helpers in this process import it


def pytest_configure(config):
    processes.WARM_BY_DEFAULT = not os.environ.get("DDP_TESTS_COLD")
    # CPU threads that wait sleep at once instead of spinning on a core another run needs (OpenMP's
    # speed only, not what it computes): 13 % less CPU time over the DiLoCo tests on 2 cores.
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    # A core for each process's CPU threads, as torchrun gives each of its ranks: the two workers'
    # runs share the cores, where a process's second thread waited at each parallel region for a
    # core the other worker held (a one-process bfloat16 run took 37 s beside two busy cores, 9 s
    # with one thread; 9.4 and 7.6 s with nothing beside it).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Every interpreter started imports torch and its kind with Python's cycle collector paused
    # (tests/cold_start/usercustomize.py): 0.2-0.3 CPU-s less a cold rank or torchrun agent. Once,
    # though the workers configure again what they inherit.
    paths = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]
    os.environ["PYTHONPATH"] = os.pathsep.join(
        dict.fromkeys([str(Path(__file__).parent / "cold_start"), *paths])
    )
    # Under pytest-xdist, the run's id names the workers' lock files (turn), removed as it ends.
    if not hasattr(config, "workerinput") and hasattr(config.option, "testrunuid"):
        config.option.testrunuid = config.option.testrunuid or uuid.uuid4().hex
        # The controller collects no tests: what it imported is frozen now (pytest_collection_finish).
        gc.freeze()


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput") and getattr(config.option, "testrunuid", None):
        for path in lock_files(config.option.testrunuid):
            path.unlink(missing_ok=True)


def pytest_collection_finish(session):
    """What the tests imported (torch, torchvision, ...) is left out of the cycle collector's full
    collections in this process: each took 120 ms, 40 % of a worker's CPU time over a few files (11
    in 4 s). The controller of pytest-xdist's workers, which collects nothing, as it is configured."""
    gc.freeze()


# Every file, the longest first (seconds on one of 2 workers: 304 to 1, 2 cores, 2026-11-28):
# pytest-xdist (-n auto; pytest.ini: --dist loadfile) hands each worker whole files in this order,
# so that the short ones fill in at the end where the other worker still runs a long one.
HEAVIEST_FIRST = [
    "test_fsdp",
    "test_distributed",
    "test_library_streams",
    "test_preemption",
    "test_stalls",
    "test_fault_tolerance",
    "test_many_machines",
    "test_elastic",
    "test_launch_variants",
    "test_records",
    "test_image_folders",
    "test_text_and_lists",
    "test_benchmark",
    "test_streams",
    "test_techniques",
    "test_multinode",
    "test_your_own_data",
    "test_randomness",
    "test_where_the_time_goes",
    "test_hugging_face_out",
    "test_docs",
    "test_host_syncs",
    "test_data",
    "test_internals",
]


def pytest_collection_modifyitems(items):
    def weight(item) -> int:
        name = item.path.stem
        return HEAVIEST_FIRST.index(name) if name in HEAVIEST_FIRST else len(HEAVIEST_FIRST)

    items.sort(key=weight)  # stable: each file's tests stay in their order


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: a worker a core, at least 2 (a test mostly waits on its ranks, which use every core
    anyway) and at most 4 (each worker's runs hold a few GB)."""
    return min(max(len(os.sched_getaffinity(0)), 2), 4)


# the test functions marked alone whose first case has run on this worker
ALONE_DONE: set[tuple[Path, str]] = set()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist, the first case of a test function marked alone (a bound on seconds that
    held with nothing beside it; the module fixtures it asks for first, which time the runs, are
    made for it) runs while no other worker runs a test; the others run side by side."""
    function = (item.path, item.originalname)
    alone = item.get_closest_marker("alone") is not None and function not in ALONE_DONE
    if alone:
        ALONE_DONE.add(function)
    with turn(alone):
        yield
    if nextitem is None or nextitem.path != item.path:
        warm_ranks.close_library_servers()


def lock_files(run_id: str) -> list[Path]:
    """The turnstile and the lock that the workers of one run share."""
    return [
        Path(tempfile.gettempdir()) / f"ddp-tests-{run_id}.{name}" for name in ("turnstile", "lock")
    ]


@contextlib.contextmanager
def turn(alone: bool):
    """Every worker's test holds the run's lock shared, an alone one holds it whole. A waiting alone
    test holds the turnstile too, so that no test starts past it."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is None:  # one process: every test runs alone
        yield
        return
    turnstile_path, lock_path = lock_files(run_id)
    with open(turnstile_path, "a") as turnstile, open(lock_path, "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(turnstile, fcntl.LOCK_UN)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the test's fixtures: its scripts start warm (tools/warm_ranks.py), unless it is marked
    real_launch (a test of the launch itself: torchrun, its agent, a README command)."""
    processes.WARM = processes.WARM_BY_DEFAULT and item.get_closest_marker("real_launch") is None


@pytest.fixture(autouse=True)
def kill_leftovers():
    yield
    while STARTED:
        kill_everything_started_by(STARTED.pop())


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> dict[str, Path]:
    """The tiny job trained once with 1 process and once with 2, for comparisons; validated mid-epoch too."""
    base = tmp_path_factory.mktemp("reference")
    exact = [*TINY, "--no-augment", *EVAL_EVERY]
    with warm_starts():  # also where a test of the launch itself asks first
        run_parallel(
            [
                (python("distributed.py", *exact, "--output-dir", base / "one"), {}),
                (torchrun(2, "distributed.py", *exact, "--output-dir", base / "two"), {}),
            ]
        )
    return {"one": base / "one", "two": base / "two"}


@pytest.fixture(scope="session")
def long_straight(tmp_path_factory) -> Path:
    """The long job (LONG) trained straight through with 2 processes: what a stopped or killed one must equal."""
    out = tmp_path_factory.mktemp("long") / "straight"
    with warm_starts():  # also where a test of the launch itself asks first
        run(torchrun(2, "distributed.py", *LONG, "--output-dir", out))
    return out
