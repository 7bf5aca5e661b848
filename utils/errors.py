"""One line for every error a user can act on: UsageError for what they can fix, run_main to end
a run in that line (error_line for a library's or PyTorch's error; a bug keeps its traceback), and
which frames are the user's (user_frame, called_from) rather than a library's or this folder's.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import re
import signal
import sys
import sysconfig
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist


class UsageError(Exception):
    """A mistake the user can fix: printed as one line, exit status 1."""

    def __str__(self) -> str:
        text = super().__str__()
        # One raised in a DataLoader worker (a file that cannot be read) comes with the worker's
        # traceback, its own line last.
        if text.startswith("Caught UsageError in DataLoader worker"):
            return text.rsplit("UsageError: ", 1)[-1].strip()
        return text


def first_line(error: BaseException) -> str:
    """The error's first line: PyTorch's distributed errors append a C++ stack trace."""
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


def raised_in(error: BaseException, *places: str) -> bool:
    """Was error raised (its innermost frame) in one of these files or folders: a library's or
    ours, not the user's?"""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(places)


def called_from(error: BaseException) -> str:
    """', at collate (distributed.py:66)': the user's line that called the library that raised
    error, if any."""
    frames = traceback.extract_tb(error.__traceback__)
    # Below this folder's frames: in the user's collate or model, not the script's call.
    ours = [i for i, frame in enumerate(frames) if frame.filename.startswith(OURS)]
    below = frames[ours[-1] + 1 :] if ours else frames
    frame = user_frame(below)
    if frame is None:
        return ""
    return f", at {frame.name} ({Path(frame.filename).name}:{frame.lineno})"


@contextlib.contextmanager
def refused_as_one_line(what: str, then: str = ""):
    """A library's refusal inside (torch's: a layer's shapes, a loss's dtypes, default_collate's
    sizes) as one line: what, its words at the user's line that called it, then; an error the
    user's code raised itself is theirs, traceback and all."""
    try:
        yield
    except (RuntimeError, ValueError, AssertionError, TypeError, IndexError, KeyError) as e:
        if not raised_in(e, *LIBRARIES):
            raise
        raise UsageError(f"{what}: {first_line(e)}{called_from(e)}{then}") from None


class Stopped(Exception):
    """Stopped by a signal after a step all ranks agreed on, and saved there."""

    def __init__(self, signum: int, epoch: int, step: int, steps: int):
        super().__init__(
            f"stopped by {signal.Signals(signum).name} after step {step}/{steps} of epoch"
            f" {epoch + 1}, saved: the same command continues from there"
        )
        self.signum = signum


def write_line(line: str) -> None:
    """A line on stderr in one write(): print() writes the newline apart, so the lines of ranks
    failing at once could run together."""
    sys.stderr.write(f"{line}\n")


def run_main(
    main: Callable[[contextlib.ExitStack], None], say: Callable[[str], object] = write_line
) -> None:
    """Run main(teardown); a user's error ends in one line, said (printed, or sent to
    distributed_mp.py's parent), and exit status 1. What main enters in teardown (the watchdog)
    is closed as main ends, before the error's line."""
    exit_code = 0
    line = None
    try:
        # Closed before the except blocks: a watchdog ending the run (this error followed from the
        # stall) ends it alone, with its own line.
        with contextlib.ExitStack() as teardown:
            main(teardown)
    except Stopped as e:
        sys.stderr.write(f"{e}\n")
        exit_code = 128 + e.signum  # as a shell reports a process ended by that signal
    except UsageError as e:
        line = f"error: {e}"
    except torch.cuda.OutOfMemoryError:
        line = "error: out of GPU memory: lower --batch-size"
    except KeyboardInterrupt:
        line = "interrupted"
    except Exception as e:
        line = error_line(e)
        if line is None:
            # A bug, the user's or ours: its traceback in one write (print_exc writes it a line
            # at a time, and the ranks that raise at once would interleave theirs), then os._exit
            # below (no exit that waits on DataLoader workers).
            sys.stderr.write(traceback.format_exc())
            exit_code = 1
    finally:
        # A line to say: torchrun's SIGTERM, sent once another rank has ended with the same error,
        # waits for it (the teardown below can take a loaded machine a second; os._exit follows).
        if line is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # After the except blocks, whose exception kept main's frames (the model, DDP, FSDP)
        # alive. W&B's records on disk before os._exit below.
        wandb = sys.modules.get("wandb")
        if wandb is not None and wandb.run is not None:
            wandb.finish(exit_code=int(exit_code != 0 or line is not None))
        # Free them and their process groups while the interpreter is whole.
        gc.collect()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if line is not None:
        # said once a node, where its ranks all end with it; each rank's is in torchrun's summary
        if first_to_say(line):
            say(line)
        record_for_torchrun(line)
        exit_code = 1
    # All written or said: end without the interpreter's shutdown, where gloo's threads still abort
    # about one 2-process run in 50 on PyTorch 2.14 ("terminate called without an active
    # exception"), after an error too.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def first_to_say(line: str) -> bool:
    """Is this rank the first of its node to end with line? Under torchrun the ranks of a node
    share their attempt's folder (the parent of each rank's error file's folder): the first to
    create a file named for the line there says it. Without torchrun, every process says its own
    (distributed_mp.py's parent says one)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    # torchrun's layout: ATTEMPT/LOCAL_RANK/error.json, a new attempt folder each start
    if not path or not Path(path).parents[1].name.startswith("attempt_"):
        return True
    said = Path(path).parents[1] / f"said-{hashlib.sha256(line.encode()).hexdigest()[:16]}"
    try:
        os.close(os.open(said, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:
        pass  # the folder cannot be written: said by each rank, as without torchrun
    return True


def record_for_torchrun(line: str) -> None:
    """Under torchrun: the line in its error file (TORCHELASTIC_ERROR_FILE), so that the summary of
    failed processes it prints after the ranks' lines names the cause ("traceback : ...") instead
    of a link to its docs. What torchrun reads is its ErrorHandler's format."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    # without "error: ": the ranks' own lines stay the only ones that start so
    cause = line.removeprefix("error: ")
    message = {
        "message": cause,
        "extraInfo": {"py_callstack": cause, "timestamp": str(int(time.time()))},
    }
    try:
        with open(path, "w") as f:
            json.dump({"message": message}, f)
    except OSError:
        pass  # the summary points at torchrun's docs, as without it


def error_line(error: Exception) -> str | None:
    """The one line for an error the user can act on that is not theirs to debug: a DataLoader
    worker killed, a failed collective. None for any other (a bug, the user's or ours), which
    keeps its traceback."""
    if not isinstance(error, (RuntimeError, ConnectionError, TimeoutError)):
        return None
    # A worker killed (out of memory, of /dev/shm) or crashed in C code, or a dataset too large
    # for /dev/shm. PyTorch's own line is the cause where it saw the signal (a forked worker).
    text = str(error)
    if text.startswith("DataLoader worker") or "unable to write to file </torch_" in text:
        said = error
        if str(error.__cause__).startswith("DataLoader worker"):
            said = error.__cause__
        what = first_line(said).split(". ")[0].rstrip(".")
        return (
            f"error: {what}: lower --workers or --batch-size where memory or /dev/shm ran out"
            " (docker run --shm-size), or see a crash with --workers 0"
        )
    # gloo reports a dead peer or a timeout as a plain RuntimeError (DistError is one too), raised
    # in torch or here; any other (a stream's own ConnectionError) is a bug: keep its traceback.
    words = r"gloo|nccl|[Cc]onnection|[Tt]imed out|[Tt]imeout|peer"
    in_torch = raised_in(error, str(Path(torch.__file__).parent), *OURS)
    if isinstance(error, dist.DistError) or (in_torch and re.search(words, text)):
        said = first_line(error)
        # a peer gone: said so, in gloo's words without its source paths and its sign-off
        peer_gone = r"Connection (closed|reset) by peer[^.]*|Broken pipe|remote process exited"
        gone = re.search(peer_gone, said)
        if gone:
            said = f"another process ended first (its own error says why): {gone[0]}"
        return f"error: distributed communication failed: {said}"
    return None


# The files of the standard library and installed packages, torch's wherever it is installed.
LIBRARIES = tuple(
    {
        *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")),
        str(Path(torch.__file__).parents[1]),
    }
)


# The modules of this folder, whatever its name: ours, not the user's.
OURS = (os.path.join(os.path.dirname(__file__), ""),)


def user_frame(frames: list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost frame of the user's code or the script (one of ours if none): not a
    library's."""
    not_libraries = [f for f in frames if not f.filename.startswith((*LIBRARIES, "<"))]
    for frame in reversed(not_libraries):
        if not frame.filename.startswith(OURS):
            return frame
    if not_libraries:
        return not_libraries[-1]
    return None
