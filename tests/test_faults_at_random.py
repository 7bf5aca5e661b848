"""Faults and flags at random, the short forms of tools/chaos.py and tools/fuzz_flags.py (docs/reliability.md has
their long runs): an elastic run through a schedule of faults ends with the straight run's weights and records, and
random flags of every script train or end every rank with one line naming a flag."""

from __future__ import annotations

import re

import chaos
import fuzz_flags
import pytest
from processes import TINY, python, run, warm_starts


@pytest.mark.real_launch  # torchrun's elastic agents, started as users start them
def test_a_schedule_of_faults_of_different_kinds_ends_with_the_straight_runs_weights_and_records(
    capsys,
):
    """Seed 22's three faults: a rank killed, a node replaced, and every agent preempted while the run recovers from
    the node's loss: each survived, weights within 1e-5 and records within 1e-6 of the straight run's, each step once."""
    with warm_starts():  # the straight run's launch is not what is checked; the agents are real
        code = chaos.main(
            ["--faults", "3", "--seed", "22", "--only", "kill_rank,replace_node,preempt"]
        )
    out = capsys.readouterr().out
    assert code == 0, out[-6000:]
    faults = re.findall(r"^fault \d+: (\w+)", out, re.M)
    assert faults == ["kill_rank", "replace_node", "preempt"], out
    assert "1 of them while the last was recovered from" in out, out
    assert "every fault survived" in out
    assert float(re.search(r"max weight difference to the straight run: (\S+)", out)[1]) <= 1e-5


def test_random_flags_of_every_script_train_or_end_in_one_line_naming_a_flag(capsys):
    """Twelve runs of random flags (seed 2) over the seven scripts: none gives a traceback, a hang or a leftover
    process; some train and some are refused."""
    code = fuzz_flags.main(["--runs", "12", "--seed", "2"])
    out = capsys.readouterr().out
    assert code == 0, out[-6000:]
    total = re.search(r"12 runs, seed 2: (\d+) trained, (\d+) refused with one line, 0 failed", out)
    assert total and int(total[1]) > 0 and int(total[2]) > 0, out[-3000:]


@pytest.mark.parametrize(
    "script, flags, line",
    [
        ("distributed_diloco.py", ["--outer-lr", "-1"], "error: --outer-lr must be > 0"),
        (
            "distributed_diloco.py",
            ["--outer-momentum", "1"],
            "error: --outer-momentum must be in [0, 1)",
        ),
        ("distributed_amp.py", ["--init-scale", "0"], "error: --init-scale must be > 0"),
        ("distributed_fsdp.py", ["--init-scale", "nan"], "error: --init-scale must be > 0"),
        ("distributed_mp.py", ["--nodes", "0"], "error: --nodes and --nproc must be at least 1"),
        (
            "distributed_fsdp.py",
            ["--channels-last"],
            "error: --channels-last: FSDP shards contiguous",
        ),
        ("distributed_mp.py", ["--nproc", "-1"], "error: --nodes and --nproc must be at least 1"),
    ],
)
def test_an_approachs_own_number_out_of_range_ends_in_one_line(script, flags, line, tmp_path):
    """Found by tools/fuzz_flags.py: DiLoCo's outer SGD raised PyTorch's ValueError for a negative --outer-lr, a
    scale of 0 or NaN was taken, --nodes 0 was said as "--node-rank must be in 0..-1" and --nproc -1 ended at once
    with exit 0, having trained nothing and said nothing, and FSDP's --channels-last ended in FSDP2's
    NotImplementedError (non-contiguous parameters); each is refused in one line naming its flag."""
    result = run(python(script, *TINY, *flags, "--output-dir", tmp_path), timeout=60, check=False)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(line), result.stderr
