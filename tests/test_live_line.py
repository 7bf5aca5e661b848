"""A terminal's live line (extras/live.py): on rank 0, where standard error is a terminal, one line rewritten in place
about once a second: the start, the step of steps with the time left, a validation's batch of batches; the records'
lines on lines of their own above it, and at the end the terminal holds the records alone. Where standard error is a
pipe or a file (every other test's runs) nothing of it is written (test_records: no "\\r")."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from processes import MARKER, ROOT, TINY, kill_everything_started_by, metrics, steps, torchrun
from projects import copy_with_your_functions

# A slow start (a tokenisation pass), slow steps and slower validation batches: the line is drawn about once a
# second, so each stage lasts a few of its draws.
SLOW = """
import time

import torch.nn.functional as F
from torch.utils.data import default_collate

from extras import builtin


def build_datasets(args):
    time.sleep(2.5)
    return builtin.datasets(args)


def build_model(args, num_classes):
    return builtin.model(args.arch, num_classes, args.image_size)


def compute_loss(outputs, targets):
    time.sleep(0.2 if outputs.requires_grad else 0.9)
    return F.cross_entropy(outputs, targets)


def collate(samples):
    return default_collate(samples)
"""


# rank 1's own error while rank 0 draws its start: it keeps its traceback, which a terminal shows whole
FAILING = SLOW.replace(
    "    time.sleep(2.5)\n",
    "    time.sleep(2.5)\n    if os.environ['RANK'] == '1':\n        raise ValueError('your own error on rank 1')\n",
).replace("import time\n", "import os\nimport time\n")


def run_in_a_terminal(cmd: list, timeout: float = 240) -> tuple[int, str]:
    """cmd with standard input, output and error a pseudo-terminal of 160 columns: its exit status and all it
    wrote there, as the terminal received it."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    marker = uuid.uuid4().hex
    env = {**os.environ, "PYTHONUNBUFFERED": "1", MARKER: marker}
    proc = subprocess.Popen(
        [str(part) for part in cmd],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    os.close(slave)
    received = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal's last writer has closed it
                break
            if not chunk:
                break
            received += chunk
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        kill_everything_started_by(marker)
        os.close(master)
    return code, received.decode(errors="replace")


def screen(text: str) -> list[str]:
    """The lines a terminal holds after text: a carriage return goes back to the line's start, ESC [K clears the
    rest of the line; the last entry is the line the cursor is on."""
    lines, line, column = [], [], 0
    for part in re.split(r"(\r|\n|\x1b\[K)", text):
        if part == "\r":
            column = 0
        elif part == "\n":
            lines.append("".join(line))
            line, column = [], 0
        elif part == "\x1b[K":
            del line[column:]
        else:
            for character in part:
                if column < len(line):
                    line[column] = character
                else:
                    line.append(character)
                column += 1
    return [*lines, "".join(line)]


def test_a_terminal_shows_rank_0s_live_line_in_place_and_keeps_the_records_on_lines_of_their_own(
    tmp_path,
):
    """2 processes under a pseudo-terminal: the live line is drawn in place (after a carriage return and a clear),
    first as the start builds the data, then as the step of steps with the percent and the time left, and as the
    validation's batch of batches; every record's and epoch's line stands on a line of its own; at the end the
    terminal holds the start's lines, the records and the epoch's line, and no half-line."""
    copy = copy_with_your_functions("distributed.py", tmp_path / "copy", SLOW)
    accumulating = copy_with_your_functions("distributed_grad_accum.py", tmp_path / "accum", SLOW)
    sharded = copy_with_your_functions("distributed_fsdp.py", tmp_path / "fsdp", SLOW)
    flags = [*TINY, "--fake-size", "600", "--epochs", "1", "--print-freq", "6", "--no-augment"]
    failing = copy_with_your_functions("distributed.py", tmp_path / "failing", FAILING)
    with ThreadPoolExecutor(4) as pool:  # at once: each mostly sleeps
        failed = pool.submit(
            run_in_a_terminal, torchrun(2, failing, *flags, "--output-dir", tmp_path / "x")
        )
        fsdp = pool.submit(
            run_in_a_terminal, torchrun(2, sharded, *flags, "--output-dir", tmp_path / "f")
        )
        straight = pool.submit(
            run_in_a_terminal, torchrun(2, copy, *flags, "--output-dir", tmp_path / "out")
        )
        accumulated = pool.submit(
            run_in_a_terminal,
            torchrun(2, accumulating, *flags, "--accum-steps", "2", "--output-dir", tmp_path / "a"),
        )
        (code, text), (accumulated_code, accumulated_text) = straight.result(), accumulated.result()
        fsdp_code, fsdp_text = fsdp.result()
        failed_code, failed_text = failed.result()
    assert code == 0, text
    # another rank's error where rank 0's live line stands: the line cleared first, the traceback whole below
    assert failed_code != 0 and "\r\x1b[Kstarting: building the data" in failed_text, failed_text
    left = screen(failed_text)
    assert "Traceback (most recent call last):" in left, left
    assert "ValueError: your own error on rank 1" in left, left
    # FSDP's line alike: its steps, its validation's batches, and a screen left with its lines alone
    assert fsdp_code == 0, fsdp_text
    assert re.search(r"\r\x1b\[Kepoch 1/1 step \d+/\d+ \d+% ", fsdp_text), fsdp_text
    assert re.search(r"\r\x1b\[Kvalidating: batch \d+/\d+ ", fsdp_text), fsdp_text
    left = [line for line in screen(fsdp_text) if line.strip()]
    assert left[-1].startswith("epoch 1/1 train_loss ") and screen(fsdp_text)[-1] == "", left
    # accumulation's steps are its optimizer steps (2 micro-batches each), never past the epoch's
    assert accumulated_code == 0, accumulated_text
    shown = re.findall(r"\r\x1b\[Kepoch 1/1 step (\d+)/(\d+) (\d+)%", accumulated_text)
    assert shown and {n for _, n, _ in shown} == {"18"}, shown
    assert all(int(s) <= 18 and int(p) <= 100 for s, _, p in shown), shown
    draws = [d.split("\r")[0].split("\n")[0] for d in text.split("\r\x1b[K")[1:]]
    drawn = [d for d in draws if d]
    assert any(d.startswith("starting: building the data and the model (") for d in drawn), drawn
    training = [d for d in drawn if re.match(r"epoch 1/1 step \d+/\d+ \d+%", d)]
    assert len(training) >= 2 and any(" | left 0:00:" in d for d in training), drawn
    assert any(" since the last step" in d for d in training), training
    assert any(re.match(r"validating: batch \d+/\d+ ", d) for d in drawn), drawn
    # the terminal as left: no live line, the records each on a line of its own, as a file would hold them
    lines = [line for line in screen(text) if line.strip()]
    assert not any(line.startswith(("starting:", "validating:", "writing ")) for line in lines), (
        lines
    )
    assert not any(re.match(r"epoch \d+/\d+ step \d+/\d+ \d+%", line) for line in lines), lines
    records = [line for line in lines if line.startswith("epoch ")]
    assert len(records) == len(steps(tmp_path / "out")) + 1, (
        lines
    )  # the records and the epoch's line
    assert lines[0].startswith("world size 2, ") and records[-1].startswith(
        "epoch 1/1 train_loss "
    ), lines
    assert screen(text)[-1] == "", screen(text)[-3:]  # the cursor on a line of its own
    assert len(metrics(tmp_path / "out")) == 1
