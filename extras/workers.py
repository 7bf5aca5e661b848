"""How DataLoader workers start and end: forked from a forkserver that imported the script once
(worker_start), leaving SIGTERM to their rank and ending with it (init_worker), and writing their
stacks when the watchdog asks (worker_stacks). A script passes workers.init_worker and
workers.worker_start(args.workers) to each DataLoader.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from utils import write_atomically

# worker_start's: each folder of a module and its real path (symbolic links followed)
REAL_FOLDERS: dict[str, str] = {}


def worker_stacks() -> list[tuple[int, list[traceback.FrameSummary], str]]:
    """(pid, frames, text) of this process's DataLoader workers: each writes its stack when
    signalled (init_worker)."""
    pids = [child.pid for child in multiprocessing.active_children()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR2)
    paths = [worker_stack_path(pid) for pid in pids]
    wait_until(lambda: all(path.exists() for path in paths), 2)
    stacks = []
    for pid, path in zip(pids, paths):
        with contextlib.suppress(OSError, ValueError):
            frames, text = json.loads(path.read_text())
            summaries = [traceback.FrameSummary(*f, lookup_line=False) for f in frames]
            stacks.append((pid, summaries, text))
            path.unlink()
    return stacks


def worker_stack_path(pid: int) -> Path:
    return Path(tempfile.gettempdir()) / f"dataloader-worker-{pid}.stack.json"


def write_worker_stack(signum: int, frame) -> None:
    stack = traceback.extract_stack(frame)
    frames = [(f.filename, f.lineno, f.name) for f in stack]
    text = "".join(traceback.format_list(stack))
    write_atomically(worker_stack_path(os.getpid()), json.dumps([frames, text]).encode())


def end_with_parent(parent) -> None:
    multiprocessing.connection.wait([parent.sentinel])
    os._exit(0)


def init_worker(worker_id: int) -> None:
    """A DataLoader worker's start: it leaves SIGTERM to its rank (torchrun, Slurm and docker stop
    signal workers too, where PyTorch's handler would end them, the epoch unsaved), and writes its
    stack when the watchdog asks."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR2, write_worker_stack)
    # Its parent is the forkserver, which PyTorch's worker loop does not watch: end with the rank.
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=end_with_parent, args=(parent,), daemon=True).start()


def worker_start(workers: int):
    """How DataLoader workers start: forked from a forkserver, a process of one thread that imported
    the script once, never from a rank's process, whose other threads (gloo's, a stream library's)
    may hold a lock of the interpreter at the fork and so deadlock the child."""
    if not workers:
        return None
    context = multiprocessing.get_context("forkserver")
    # It imports, once, the modules this process has imported from the script's folder (the script
    # as a module) and from this folder, whatever its name (ddp_utils.builtin), so that the workers
    # need not; Python passes no path to it, so the folders above them go in PYTHONPATH while it
    # starts.
    script = getattr(sys.modules["__main__"], "__file__", None) or __file__
    script_folder = os.path.dirname(os.path.realpath(script))
    ours = os.path.dirname(os.path.realpath(__file__))
    modules = {__name__}
    files = {
        name: m.__file__ for name, m in list(sys.modules.items()) if getattr(m, "__file__", None)
    }
    # each folder resolved once a process, not each module's path (torch's 2,300 modules in 310
    # folders: 115 ms a DataLoader; each folder at each DataLoader: 20 ms)
    REAL_FOLDERS.update(
        (folder, os.path.realpath(folder))
        for folder in set(map(os.path.dirname, files.values())) - REAL_FOLDERS.keys()
    )
    for name, file in files.items():
        folder = REAL_FOLDERS[os.path.dirname(file)]
        if folder == script_folder and Path(file).stem.isidentifier():
            modules.add(Path(file).stem)
        elif folder == ours:
            modules.add(name)
    context.set_forkserver_preload(sorted(modules))
    start_forkserver([script_folder, os.path.dirname(ours)])
    # At this process's exit, multiprocessing would send its workers SIGTERM, which they leave to
    # it, and wait for them forever (a run ended by an error mid-epoch): they are killed first.
    atexit.unregister(kill_workers)
    atexit.register(kill_workers)
    return context


def kill_workers() -> None:
    """SIGKILL to this process's DataLoader workers still running (daemonic children: a process
    of the user's own is left to multiprocessing)."""
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


def start_forkserver(folders: list[str]) -> None:
    """Start multiprocessing's forkserver now (and its resource tracker), finding the modules it
    preloads in folders."""
    # It reads PYTHONPATH, not sys.path, whatever the working directory. A rank that ends at once
    # (an error, a stall) leaves its workers' named semaphores to the resource tracker, which frees
    # them and would warn about each on stderr: the two processes alone start with that warning
    # off, and this process's environment is as it was after.
    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", "PYTHONWARNINGS")}
    path, warnings = saved["PYTHONPATH"], saved["PYTHONWARNINGS"]
    os.environ["PYTHONPATH"] = os.pathsep.join([*folders, *([path] if path else [])])
    quiet = "ignore:resource_tracker"
    os.environ["PYTHONWARNINGS"] = ",".join([*([warnings] if warnings else []), quiet])
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def wait_until(condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
