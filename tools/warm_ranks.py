"""Ranks started warm: a script run as `python SCRIPT ...`, or as N ranks the way torchrun starts
them (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ... set), in processes forked from a server that
has imported torch once, instead of N fresh interpreters that import it each (about 2 s of CPU a
process, most of what a test's tiny run costs). The scripts run unchanged, as __main__ with their
argv, environment, folder and working directory, their output in pipes, each killable as a process
(SIGTERM, SIGUSR1, SIGKILL). tools/processes.py starts every such command so, except where a test is
about the launch itself (real torchrun, its agent, elastic runs) or the command's interpreter
would start otherwise (PYTHONHASHSEED, glibc's MALLOC_ settings and the like): those start as they
always did. A PYTHONPATH of the command's own is read as a fresh interpreter reads it: its
sitecustomize.py runs before the script; where a folder there holds a module the server has
imported (a stand-in for a package), the child execs a fresh interpreter.

The server (this file run as a program) imports torch and the libraries the scripts import (a
script that imports datasets, transformers, peft or webdataset: a server forked from it that ran
its import lines too), then waits on a Unix socket; for each request it forks, and the child becomes the
script's process: its own session, the request's pipes as stdin, stdout and stderr. The server stays one thread, so a
fork never copies a lock another thread holds, and reports each child's exit status.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import pickle
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

# What the server's interpreter settles at its start, and the scripts' own folder sets before torch
# loads: a run that asks for other values is started the ordinary way. PYTHONPATH is not among
# them: the child reads its own (become).
STARTUP = (
    "PYTHONHASHSEED",
    "PYTHONWARNINGS",
    "PYTHONSTARTUP",
    "PYTHONOPTIMIZE",
    "PYTHONDEVMODE",
    "PYTHONSAFEPATH",
    "LD_PRELOAD",
    "TORCH_CPP_LOG_LEVEL",
    "CUDA_VISIBLE_DEVICES",
    "OMP_WAIT_POLICY",
    "PROCLOG",
)
# glibc's allocator reads these once, as the process starts (MALLOC_MMAP_THRESHOLD_ and the like)
GLIBC_AT_START = ("MALLOC_", "GLIBC_TUNABLES")
# The libraries of the users' code in the tests (test-only dependencies): a script that imports
# them (0.7 s of CPU for datasets, 1.7 s for transformers' GPT-2, in each rank) starts from a server
# that ran its import lines too, with what those libraries read as they are imported (the hub's
# caches and offline switches, webdataset's cache) as the script's environment sets it.
LIBRARIES = re.compile(
    r"^ *((?:from|import) (?:datasets|peft|transformers|webdataset)\b[^(\n]*)$", re.M
)
LIBRARIES_AT_IMPORT = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "WDS_", "USE_", "XDG_", "HOME")
SERVER_ENV = {"PYTHONUNBUFFERED": "1"}
# torch's CPU threads in the server, as its environment set them
DEFAULT_THREADS: list[int] = []


# ---- the server ----


def preload() -> None:
    """What the scripts import, imported once (torchvision too: the built-in models, an image
    folder)."""
    import numpy  # noqa: F401
    import PIL.Image  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.nn.functional  # noqa: F401
    import torch.nn.parallel  # noqa: F401
    import torch.utils.data  # noqa: F401
    import torchvision  # noqa: F401
    import torchvision.transforms.v2  # noqa: F401


def serve(fd: int) -> None:
    """The tests' own server: torch and what the scripts import, then a child forked for each
    request on the socket (a script's rank, or a server of a script's libraries)."""
    preload()
    # What the imports made is left out of every later collection: a child's collections (the
    # scripts' own gc.collect() as they end, a DataLoader worker's) then never write to the pages it
    # shares with the server, which the kernel would copy for it. 10 % of the suite's CPU time.
    gc.freeze()
    DEFAULT_THREADS.append(sys.modules["torch"].get_num_threads())
    SERVER_PATH.extend(folders_of(os.environ))
    BASE_PATH.extend(sys.path[1 + len(SERVER_PATH) :])
    fork_for_each_request(socket.socket(fileno=fd))


def serve_libraries(fd: int, request: dict) -> None:
    """In a child of the tests' own server: import a script's libraries (the request's import
    lines) in the environment they read as they load, then serve the scripts that import them."""
    os.environ.clear()
    os.environ.update(request["env"])
    for line in request["imports"]:
        try:
            exec(line, {})
        except Exception:  # the script's own import says why, as it would without the server
            pass
    gc.freeze()
    fork_for_each_request(socket.socket(fileno=fd))
    os._exit(0)


def fork_for_each_request(server: socket.socket) -> None:
    """Fork a child for each request on the socket; report each child's end. Ends with the
    client."""
    assert threading.active_count() == 1, "a thread in the server would be copied mid-lock"
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj is not server:
                # a child ended: its pidfd is readable
                pid = key.data
                _, status = os.waitpid(pid, 0)
                selector.unregister(key.fileobj)
                os.close(key.fileobj)
                server.send(pickle.dumps(("ended", pid, os.waitstatus_to_exitcode(status))))
                continue
            message, fds, _, _ = socket.recv_fds(server, 1 << 20, 3)
            if not message:
                return  # the client is gone
            request = pickle.loads(message)
            pid = os.fork()
            if pid == 0:
                selector.close()
                server.close()
                if "imports" in request:
                    serve_libraries(fds[0], request)  # never returns
                become(request, fds)  # never returns
            for descriptor in fds:
                os.close(descriptor)
            selector.register(os.pidfd_open(pid), selectors.EVENT_READ, pid)
            server.send(pickle.dumps(("started", request["id"], pid)))


def become(request: dict, fds: list[int]) -> None:
    """In the forked child: become `python SCRIPT ARGS` in its folder and environment, and exit as
    that process would."""
    os.setsid()  # a session of its own, as the tests start every command
    for target, descriptor in zip((0, 1, 2), fds):
        os.dup2(descriptor, target)
        os.close(descriptor)
    os.chdir(request["cwd"])
    pythonpath = folders_of(request["env"])
    if shadows(pythonpath):  # a fresh interpreter would import another module than the server did
        os.execve(sys.executable, [sys.executable, *request["argv"]], request["env"])
    start_afresh(request["cwd"], request["env"])
    script = os.path.abspath(request["argv"][0])
    sys.argv = list(request["argv"])
    # The path a fresh interpreter builds from PYTHONPATH, and the site hooks it runs there before
    # the script's folder comes first (a sitecustomize.py that stands in for an older torch).
    sys.path[:] = [*pythonpath, *BASE_PATH]
    site_hooks()
    sys.path.insert(0, os.path.dirname(script))
    keep_a_zygote()
    with open(script, "rb") as f:
        run_as_main(compile(f.read(), script, "exec"), script)


def folders_of(env: dict) -> list[str]:
    """The folders of env's PYTHONPATH, in order."""
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def shadows(pythonpath: list[str]) -> bool:
    """Does a folder of pythonpath that the server's lacks hold a module the server has imported
    (a stand-in for a package, put first)?"""
    for folder in pythonpath:
        if folder not in SERVER_PATH and os.path.isdir(folder):
            if any(name.partition(".")[0] in sys.modules for name in os.listdir(folder)):
                return True
    return False


def site_hooks() -> None:
    """The sitecustomize and usercustomize modules a fresh interpreter imports at its start (those
    the server imported stay as they are)."""
    import site

    site.execsitecustomize()
    if site.ENABLE_USER_SITE:
        site.execusercustomize()


def start_afresh(cwd: str, env: dict) -> None:
    """What a fresh interpreter in cwd with env would have, where the fork left the server's (or
    its rank's): the environment, unbuffered stdio on descriptors 0-2, its own random streams and
    multiprocessing key, the CPU threads OMP_NUM_THREADS gives."""
    import io
    import multiprocessing
    import random

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # Unbuffered, as PYTHONUNBUFFERED makes a fresh interpreter's.
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), write_through=True
    )
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace"
    )
    # Each child its own random streams, as a fresh interpreter draws them (torch's default seed is
    # fixed and still untouched).
    random.seed()
    sys.modules["numpy"].random.seed()
    multiprocessing.current_process().authkey = os.urandom(32)
    # The CPU threads a fresh interpreter takes from OMP_NUM_THREADS at its start (torchrun sets 1
    # for each of several workers); without it, the server's own, one a core.
    threads = os.environ.get("OMP_NUM_THREADS")
    sys.modules["torch"].set_num_threads(int(threads) if threads else DEFAULT_THREADS[0])


def run_as_main(code, file: str | None) -> None:
    """Run code as the module __main__ (of file, or of `python -c`) and exit as that interpreter
    would: SystemExit's code, or 1 with the traceback from the code's own frame on."""
    import builtins
    import types

    main = types.ModuleType("__main__")
    if file is not None:
        main.__file__ = file
    main.__builtins__ = builtins
    main.__spec__ = None
    sys.modules["__main__"] = main
    status = 0
    try:
        exec(code, main.__dict__)
    except SystemExit as e:
        status = e.code
    except BaseException as e:
        e.with_traceback(e.__traceback__.tb_next)
        sys.excepthook(type(e), e, e.__traceback__)
        status = 1
    exit_without_teardown(status)


def exit_without_teardown(status) -> None:
    """What Python's exit does first (the threads that are not daemons joined, the atexit handlers
    run, the streams flushed), then the process ends without the teardown of torch's modules: a
    second a process of the suite's time (a user's run pays it, as every PyTorch program does)."""
    import atexit

    code = 0
    if isinstance(status, int):
        code = status
    elif status is not None:  # sys.exit("message"): said, and status 1
        sys.stderr.write(f"{status}\n")
        code = 1
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


# ---- what a warm rank would start afresh: its DataLoader workers' forkserver, mp.spawn's ranks ----

# the code multiprocessing runs in such an interpreter (`python -c CODE`)
WARM_CHILDREN = (
    "from multiprocessing.forkserver import main",
    "from multiprocessing.spawn import spawn_main",
)
PR_SET_CHILD_SUBREAPER = 36
BASE_PATH: list[str] = []  # sys.path without its first entry and PYTHONPATH's
SERVER_PATH: list[str] = []  # the server's PYTHONPATH


def keep_a_zygote() -> None:
    """In a rank, before its script runs: fork a copy of it (one thread, torch imported), the
    zygote, which forks each interpreter multiprocessing would start afresh with `python -c`, and
    have multiprocessing ask it. multiprocessing waits on such a process as its own child: the
    zygote forks twice, and the rank, a child subreaper, adopts the grandchild."""
    import ctypes
    import multiprocessing.util

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if os.fork() == 0:
        ours.close()
        serve_zygote(theirs)  # never returns (a grandchild leaves it by SystemExit, as it ends)
    theirs.close()
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    fresh = multiprocessing.util.spawnv_passfds
    lock = threading.Lock()

    def spawnv_passfds(path, args, passfds):
        code = args[args.index("-c") + 1] if "-c" in args else ""
        if os.fsdecode(path) != sys.executable or not code.startswith(WARM_CHILDREN):
            return fresh(path, args, passfds)
        passfds = sorted(map(int, passfds))
        rest = args[args.index("-c") + 2 :]
        request = {
            "code": code,
            "argv": rest,
            "fds": passfds,
            "cwd": os.getcwd(),
            "env": dict(os.environ),
        }
        try:
            with lock:
                socket.send_fds(ours, [pickle.dumps(request)], [0, 1, 2, *passfds])
                return pickle.loads(ours.recv(1 << 10))
        except (OSError, EOFError):  # the zygote is gone (a signal to the session)
            return fresh(path, args, passfds)

    multiprocessing.util.spawnv_passfds = spawnv_passfds


def serve_zygote(sock: socket.socket) -> None:
    """The zygote's loop: for each request, a grandchild that runs its code; ends with its rank."""
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 256)
        except OSError:
            message = b""
        if not message:
            os._exit(0)
        request = pickle.loads(message)
        read, write = os.pipe()
        middle = os.fork()
        if middle == 0:
            child = os.fork()
            if child == 0:
                sock.close()
                os.close(read)
                os.close(write)
                run_as_python_c(request, fds)  # never returns
            os.write(write, str(child).encode())
            os._exit(0)
        os.close(write)
        child = int(os.read(read, 32))
        os.close(read)
        os.waitpid(middle, 0)  # it is gone, and the rank has adopted the grandchild
        for fd in fds:
            os.close(fd)
        sock.send(pickle.dumps(child))


def run_as_python_c(request: dict, fds: list[int]) -> None:
    """In the zygote's grandchild: become `python -c CODE ARGS` started with the rank's stdio and
    the descriptors it passed (at their numbers), nothing else open."""
    import fcntl

    targets = [0, 1, 2, *request["fds"]]
    above = max(targets + fds) + 1
    kept = [fcntl.fcntl(fd, fcntl.F_DUPFD, above) for fd in fds]
    for name in os.listdir("/proc/self/fd"):
        if int(name) not in kept:
            try:
                os.close(int(name))
            except OSError:
                pass
    for target, fd in zip(targets, kept):
        os.dup2(fd, target)
        os.close(fd)
    start_afresh(request["cwd"], request["env"])
    sys.argv = ["-c", *request["argv"]]
    sys.path[:] = ["", *folders_of(os.environ), *BASE_PATH]
    if request["code"].startswith(WARM_CHILDREN[1]):  # mp.spawn's rank: its own workers' forkserver
        keep_a_zygote()
    run_as_main(compile(request["code"], "<string>", "exec"), None)


# ---- the client: a server per test process, and one for each script's libraries ----


def fits(env: dict) -> bool:
    """Would a fresh interpreter with env start as a server does (the libraries aside)?"""
    ours = {**os.environ, **SERVER_ENV}
    names = {*STARTUP, *(n for n in {*env, *ours} if n.startswith(GLIBC_AT_START))}
    return all(env.get(name) == ours.get(name) for name in names)


def libraries(script: str, env: dict) -> tuple:
    """The script's import lines of a library, and what those libraries read at their import, as
    env sets it; () where it imports none (the tests' own server)."""
    try:
        with open(script) as f:
            imports = tuple(dict.fromkeys(LIBRARIES.findall(f.read())))
    except OSError:  # no such script: it ends as python would, from the tests' own server
        imports = ()
    variables = tuple(sorted((k, v) for k, v in env.items() if k.startswith(LIBRARIES_AT_IMPORT)))
    return (imports, variables) if imports else ()


class Server:
    """A server process and its socket; started at the first warm command that needs it."""

    def __init__(self, libraries: tuple):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        imports, variables = libraries or ((), ())
        self.env = {**os.environ, **SERVER_ENV}
        if imports:  # what the libraries read at their import, as the script's environment
            self.env = {k: v for k, v in self.env.items() if not k.startswith(LIBRARIES_AT_IMPORT)}
            self.env.update(variables)
        if imports:  # forked from the tests' own server: torch is imported once a test process
            self.process = server(()).fork_server(imports, self.env, theirs.fileno())
        else:
            self.process = subprocess.Popen(
                [sys.executable, __file__, str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
        theirs.close()
        self.socket = ours
        self.ended: dict[int, int] = {}
        self.started: dict[str, int] = {}
        self.forks = 0
        self.lock = threading.Lock()

    def start(self, argv: list[str], env: dict, cwd: str, stdout: int, stderr: int) -> int:
        """The pid of a child running argv, writing to stdout and stderr (descriptors)."""
        stdin = os.open(os.devnull, os.O_RDONLY)
        request = {"id": uuid.uuid4().hex, "argv": argv, "env": env, "cwd": str(cwd)}
        with self.lock:
            socket.send_fds(self.socket, [pickle.dumps(request)], [stdin, stdout, stderr])
        os.close(stdin)
        self.forks += 1
        deadline = time.monotonic() + 60
        while request["id"] not in self.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the warm-start server did not start a process in 60 s")
            self.receive(timeout=1)
        return self.started.pop(request["id"])

    def fork_server(self, imports: tuple, env: dict, fd: int) -> ForkedServer:
        """A server of these import lines, forked from this one, serving on fd."""
        request = {"id": uuid.uuid4().hex, "imports": imports, "env": env}
        with self.lock:
            socket.send_fds(self.socket, [pickle.dumps(request)], [fd])
        while request["id"] not in self.started:
            self.receive(timeout=1)
        return ForkedServer(self, self.started.pop(request["id"]))

    def receive(self, timeout: float) -> None:
        """Take the server's messages: the first within timeout, then those already there."""
        with self.lock:
            while True:
                self.socket.settimeout(timeout)
                try:
                    message = self.socket.recv(1 << 16)
                except (TimeoutError, BlockingIOError):
                    return
                finally:
                    self.socket.settimeout(None)
                if not message:
                    raise RuntimeError("the warm-start server ended")
                kind, key, value = pickle.loads(message)
                if kind == "started":
                    self.started[key] = value
                else:
                    self.ended[key] = value
                timeout = 0

    def exit_code(self, pid: int) -> int | None:
        self.receive(timeout=0)
        return self.ended.get(pid)


class ForkedServer:
    """A server of a script's libraries, forked from the tests' own: waited on and killed as a
    subprocess.Popen is."""

    def __init__(self, parent: Server, pid: int):
        self.parent, self.pid = parent, pid

    def poll(self) -> int | None:
        return self.parent.exit_code(self.pid)

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self) -> int:
        while self.poll() is None:
            self.parent.receive(timeout=0.05)
        return self.poll()


# the tests' own server (torch and torchvision), and one for each script's libraries
SERVERS: dict[tuple, Server] = {}


def server(libraries: tuple) -> Server:
    """The server that imported these libraries (started if need be)."""
    if libraries not in SERVERS or SERVERS[libraries].process.poll() is not None:
        SERVERS[libraries] = Server(libraries)
    return SERVERS[libraries]


def close_library_servers() -> None:
    """End each server of a script's libraries whose runs have all ended (the tests call it at the
    end of each file: a server holds about 1 GB, and a larger one forks slower)."""
    for libraries, other in list(SERVERS.items()):
        if not libraries:
            continue
        other.receive(timeout=0)
        if len(other.ended) >= other.forks:
            other.process.kill()
            other.process.wait()
            other.socket.close()
            del SERVERS[libraries]


class WarmRun:
    """What subprocess.Popen gives, for ranks started warm: one process (`python SCRIPT`), or N
    ranks as torchrun starts them, whose exit code is torchrun's (0, or 1 where a rank failed;
    the others then get SIGTERM, and SIGKILL 30 s later, as torchrun's agent does), and whose
    stderr ends, where a rank failed, with what torchrun's summary says of each: the error file
    it wrote, as "  traceback : MESSAGE"."""

    GRACE = 30

    def __init__(
        self,
        server: Server,
        args: list,
        pids: list[int],
        outputs: list[int],
        attempt: str | None,
    ):
        self.server = server
        self.args = args
        self.pids = pids
        self.pid = pids[0]
        self.torchrun = attempt is not None
        self.attempt = attempt  # torchrun's attempt folder, each rank's error file in it
        self.returncode = None
        self.codes: dict[int, int] = {}
        self.outputs = outputs  # read ends: stdout, stderr
        self.chunks: dict[int, list[bytes]] = {fd: [] for fd in outputs}
        self.open = set(outputs)
        self.stopping_since = None

    def poll(self) -> int | None:
        for pid in self.pids:
            if pid not in self.codes:
                code = self.server.exit_code(pid)
                if code is not None:
                    self.codes[pid] = code
        if self.torchrun and any(self.codes.values()) and len(self.codes) < len(self.pids):
            if self.stopping_since is None:
                self.stopping_since = time.monotonic()
                self.send_signal(signal.SIGTERM)
            elif time.monotonic() - self.stopping_since > self.GRACE:
                self.kill()
        if len(self.codes) == len(self.pids):
            codes = [self.codes[pid] for pid in self.pids]
            self.returncode = codes[0]
            if self.torchrun:
                self.returncode = int(any(codes))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.server.receive(timeout=0.05)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Everything the ranks wrote, once they ended and their pipes closed; on a timeout, the
        next call goes on (as Popen's)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        selector = selectors.DefaultSelector()
        for fd in self.open:
            selector.register(fd, selectors.EVENT_READ)
        try:
            while self.open or self.poll() is None:
                if deadline is not None and time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                for key, _ in selector.select(timeout=0.05):
                    data = os.read(key.fd, 1 << 16)
                    if data:
                        self.chunks[key.fd].append(data)
                    else:
                        selector.unregister(key.fd)
                        self.open.discard(key.fd)
                        os.close(key.fd)
                if not self.open:
                    self.wait(None if deadline is None else max(0, deadline - time.monotonic()))
        finally:
            selector.close()
        out, err = (b"".join(self.chunks[fd]).decode(errors="replace") for fd in self.outputs)
        return out, err + self.summary()

    def summary(self) -> str:
        """torchrun's summary of the failed ranks, their error files' messages (once: the
        attempt's folder goes)."""
        if self.attempt is None:
            return ""
        lines = []
        for rank, pid in enumerate(self.pids):
            path = os.path.join(self.attempt, str(rank), "error.json")
            if self.codes.get(pid) and os.path.exists(path):
                with open(path) as f:
                    lines.append(f"  traceback : {json.load(f)['message']['message']}\n")
        shutil.rmtree(os.path.dirname(self.attempt), ignore_errors=True)
        self.attempt = None
        return "".join(lines)

    def send_signal(self, signum: int) -> None:
        for pid in self.pids:
            if pid not in self.codes:
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to each live rank's session: the rank and whatever it forked."""
        self.poll()
        for pid in self.pids:
            if pid in self.codes:
                continue
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def command_to_start(cmd: list) -> tuple[int, list[str]] | None:
    """(ranks, [script, *args]) for `python SCRIPT ARGS` or torchrun's `--standalone
    --nproc_per_node=N SCRIPT ARGS`; None for any other command."""
    cmd = [str(c) for c in cmd]
    if len(cmd) < 2 or cmd[0] != sys.executable:
        return None
    if cmd[1].endswith(".py"):
        return 1, cmd[1:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    if cmd[:4] == torchrun and len(cmd) > 5 and cmd[4].startswith("--nproc_per_node="):
        if cmd[5].endswith(".py"):
            return int(cmd[4].split("=")[1]), cmd[5:]
    return None


def start(cmd: list, env: dict, cwd, port: int) -> WarmRun | None:
    """cmd started warm (port: the rendezvous of torchrun's ranks), or None where it cannot be.
    The ranks share one stdout and one stderr, as torchrun's workers share the agent's."""
    launch = command_to_start(cmd)
    if launch is None or not fits(env):
        return None
    ranks, argv = launch
    warm = server(libraries(os.path.join(cwd, argv[0]), env))
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    envs, attempt = [env], None
    if "torch.distributed.run" in [str(c) for c in cmd]:
        attempt = os.path.join(tempfile.mkdtemp(prefix="torchelastic_"), "attempt_0")
        envs = torchrun_env(env, ranks, port, attempt)
    try:
        pids = [warm.start(argv, e, cwd, out_write, err_write) for e in envs]
    finally:
        os.close(out_write)
        os.close(err_write)
    return WarmRun(warm, cmd, pids, [out_read, err_read], attempt)


def torchrun_env(env: dict, ranks: int, port: int, attempt: str) -> list[dict]:
    """What torchrun's agent sets for each worker on one node; rank 0 holds the store; each
    rank's error file in a folder of its own in the attempt's folder."""
    run_id = uuid.uuid4().hex
    envs = []
    for rank in range(ranks):
        os.makedirs(os.path.join(attempt, str(rank)))
        rank_env = {
            **env,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "WORLD_SIZE": str(ranks),
            "LOCAL_WORLD_SIZE": str(ranks),
            "ROLE_WORLD_SIZE": str(ranks),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_ERROR_FILE": os.path.join(attempt, str(rank), "error.json"),
        }
        if ranks > 1:
            rank_env.setdefault("OMP_NUM_THREADS", "1")
        envs.append(rank_env)
    return envs


if __name__ == "__main__":
    serve(int(sys.argv[1]))
