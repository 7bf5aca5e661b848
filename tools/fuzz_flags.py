"""Random flags: every script run with random combinations of its flags, valid and invalid (numbers
out of range, pairs that cannot go together, paths that cannot work, world sizes against batch
sizes), each for a step or two of a tiny job. Each run must train, or end every rank with one line
that names a flag it was given: never a Python traceback of the scripts, a hang (no run of this
size takes 90 s) or a process left behind. torchrun's own summary of a failed process, and its own
traceback of ChildFailedError, are torchrun's and allowed.

    python tools/fuzz_flags.py --runs 200 --seed 1
    python tools/fuzz_flags.py --runs 1 --seed 1 --skip 57    # replay the 58th run of that schedule

It prints how many runs trained and how many were refused, per script, and every run that failed
with its command, its reason and its replay line; it exits non-zero where one failed. Runs start
warm (forked from a process that imported torch, tools/warm_ranks.py: what is checked is the
output, not the launch); --cold starts each as users do.

Left out: --compile (a compile takes a minute a run on a CPU; the compile tests run it), and
--dataset cifar10/cifar100 and --wandb with a network (this never reaches one: the download and
W&B's online mode are refused or made offline).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]
import processes  # noqa: E402
from processes import (  # noqa: E402
    OFFLINE,
    PYTHON,
    finish,
    free_port,
    processes_with_marker,
    python,
    start,
    torchrun,
)

SCRIPTS = (
    "dataparallel.py",
    "distributed.py",
    "distributed_mp.py",
    "distributed_amp.py",
    "distributed_grad_accum.py",
    "distributed_fsdp.py",
    "distributed_diloco.py",
)
DDP = {"distributed.py", "distributed_mp.py", "distributed_amp.py", "distributed_grad_accum.py"}
# Where each flag exists: every script, or those named.
ONLY = {
    "--gpu": {"dataparallel.py"},
    "--sync-bn": DDP,
    "--find-unused-parameters": DDP,
    "--comm-hook": DDP,
    "--local-rank": set(SCRIPTS) - {"dataparallel.py", "distributed_mp.py"},
    "--nproc": {"distributed_mp.py"},
    "--nodes": {"distributed_mp.py"},
    "--node-rank": {"distributed_mp.py"},
    "--amp-dtype": {"distributed_amp.py", "distributed_fsdp.py"},
    "--init-scale": {"distributed_amp.py", "distributed_fsdp.py"},
    "--accum-steps": {"distributed_grad_accum.py"},
    "--sync-every-micro-batch": {"distributed_grad_accum.py"},
    "--activation-checkpointing": {"distributed_fsdp.py"},
    "--cpu-offload": {"distributed_fsdp.py"},
    "--replicate": {"distributed_fsdp.py"},
    "--inner-steps": {"distributed_diloco.py"},
    "--outer-lr": {"distributed_diloco.py"},
    "--outer-momentum": {"distributed_diloco.py"},
}
SWITCH = None  # a flag without a value
# Each flag's values: (valid ones, invalid ones); {dir}, {file} and {port} are filled in per run.
VALUES = {
    "--dataset": (["fake"], ["nonsense", "imagefolder"]),
    "--data-dir": (["{dir}/data"], ["{file}/data"]),
    "--no-download": SWITCH,
    "--fake-size": (["40", "100"], ["0", "-1", "3", "x"]),
    "--image-size": (["16", "24"], ["0", "-4", "1", "x"]),
    "--no-augment": SWITCH,
    "--arch": (["tiny", "resnet18"], ["no_such_arch", ""]),
    "--epochs": (["1", "2"], ["0", "-1", "x"]),
    "--steps-per-epoch": (["1", "3"], ["0", "-2"]),
    "--stop-after": (["1"], ["0", "-1"]),
    "--batch-size": (["8", "6", "3"], ["0", "-8", "1", "100000"]),
    "--optimizer": (["sgd", "adamw"], ["adam"]),
    "--lr": (["0.1", "1e-3"], ["-1", "nan", "x"]),
    "--warmup": (["0", "0.5"], ["1", "-0.1", "x"]),
    "--momentum": (["0", "0.5"], ["-1", "x"]),
    "--weight-decay": (["0", "1e-4"], ["-1"]),
    "--clip-grad": (["1.0"], ["0", "-1"]),
    "--workers": (["0", "1"], ["-1", "x"]),
    "--seed": (["0", "7"], ["-1"]),
    "--print-freq": (["1", "5"], ["0", "-1"]),
    "--eval-every": (["1"], ["0", "-1"]),
    "--tensorboard": SWITCH,
    "--wandb": (["fuzz"], []),
    "--ema": (["0.9", "0"], ["1", "-0.5"]),
    "--keep-best": (["val_loss", "val_acc"], ["no_such_metric"]),
    "--keep-best-mode": (["min", "max"], ["median"]),
    "--ip": (["127.0.0.1"], ["no.such.host.invalid"]),
    "--port": (["{port}"], ["-1", "70000"]),
    "--dist-url": (["env://"], ["bogus://x"]),
    "--backend": (["gloo"], ["nccl"]),
    "--timeout": (["60"], ["0", "-1"]),
    "--channels-last": SWITCH,
    "--peak-tflops": (["100"], ["0", "-1"]),
    "--phases": SWITCH,
    "--no-live-line": SWITCH,
    "--no-watchdog": SWITCH,
    "--no-sample-seeds": SWITCH,
    "--no-checks": SWITCH,
    "--profile": (["1:2"], ["2:1", "x"]),
    "--compile-mode": (["default"], ["fastest"]),
    "--output-dir": (["{dir}/out"], ["{file}/out"]),
    "--save-every": (["1"], ["0", "-1"]),
    "--save-minutes": (["0.01"], ["0", "-1"]),
    "--gpu": ([], ["0"]),
    "--sync-bn": SWITCH,
    "--find-unused-parameters": SWITCH,
    "--comm-hook": (["bf16"], ["fp16"]),
    "--local-rank": (["0"], ["x"]),
    "--nproc": (["1", "2"], ["0", "-1"]),
    "--nodes": (["1"], ["0"]),
    "--node-rank": (["0"], ["-1", "5"]),
    "--amp-dtype": (["bfloat16", "float16"], ["float8"]),
    "--init-scale": (["1024"], ["0", "-1"]),
    "--accum-steps": (["2"], ["0", "-1", "100"]),
    "--sync-every-micro-batch": SWITCH,
    "--activation-checkpointing": SWITCH,
    "--cpu-offload": SWITCH,
    "--replicate": (["1", "2"], ["0", "3"]),
    "--inner-steps": (["1", "2"], ["0"]),
    "--outer-lr": (["0.7"], ["-1", "0"]),
    "--outer-momentum": (["0.5"], ["-0.1", "1"]),
}
# A tiny job, two steps; a flag drawn replaces its value here.
BASE = {
    "--dataset": "fake",
    "--arch": "tiny",
    "--fake-size": "64",
    "--image-size": "16",
    "--batch-size": "8",
    "--epochs": "1",
    "--steps-per-epoch": "2",
    "--workers": "0",
    "--timeout": "30",
    "--output-dir": "{dir}/out",
}
RUN_SECONDS = 90
TORCHRUN_TRACE = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"


def draw(rng: random.Random, script: str) -> tuple[dict, int, list[str]]:
    """A run's flags (BASE with 0 to 4 flags drawn, each invalid one time in four), its processes
    (1 to 3; mp.spawn's and DataParallel's their own) and the flags drawn."""
    flags = dict(BASE)
    names = [name for name in VALUES if script in ONLY.get(name, SCRIPTS)]
    drawn = rng.sample(names, rng.randint(0, 4))
    for name in drawn:
        if VALUES[name] is SWITCH:
            flags[name] = SWITCH
            continue
        valid, invalid = VALUES[name]
        # an invalid value one time in four: always where the flag has no valid one here
        pool = valid
        if invalid and (not valid or rng.random() < 0.25):
            pool = invalid
        flags[name] = rng.choice(pool)
    return flags, rng.choice([1, 2, 2, 3]), drawn


def command(script: str, flags: dict, nproc: int, folder: Path) -> list:
    """The command a user would type, the placeholders filled in."""
    file = folder / "a-file"
    file.write_text("not a directory")
    fill = dict(dir=folder, file=file, port=free_port())
    args = []
    for name, value in flags.items():
        args.append(name)
        if value is not SWITCH:
            args.append(value.format(**fill))
    if script == "dataparallel.py" or script == "distributed_mp.py":
        if script == "distributed_mp.py" and "--nproc" not in flags:
            args += ["--nproc", str(nproc)]
        return python(script, *args)
    return torchrun(nproc, script, *args)


def tracebacks(stderr: str) -> list[str]:
    """The Python tracebacks in stderr that are not torchrun's own (ChildFailedError): each its
    last line."""
    found = []
    lines = stderr.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last)"):
            end = next((t for t in lines[i + 1 :] if t and not t.startswith(" ")), "")
            if not end.startswith(TORCHRUN_TRACE):
                found.append(end or line)
    return found


def verdict(result, given: set[str], leftover: list[int], out: Path) -> tuple[str, str]:
    """("trained" | "refused" | "failed", why): a run that exits 0 trained only where it saved."""
    if leftover:
        return "failed", f"processes left running: {leftover}"
    traces = tracebacks(result.stderr)
    if traces:
        return "failed", f"a traceback: {traces[0]}"
    if result.returncode == 0:
        if not (out / "checkpoint.pt").exists() and not (out / "checkpoint").is_dir():
            return "failed", f"exit 0 without a checkpoint in {out}: nothing trained, nothing said"
        return "trained", ""
    said = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    if not said:
        return "failed", f"exit {result.returncode} without an error line"
    named = [line for line in said if any(flag in line for flag in given)]
    if not named:
        return "failed", f"the line names no flag given: {said[0]}"
    return "refused", named[0]


def one_run(script: str, flags: dict, nproc: int, folder: Path) -> tuple[str, str, list]:
    cmd = command(script, flags, nproc, folder)
    env = {**OFFLINE, "OMP_NUM_THREADS": "1"}
    proc, marker = start(cmd, env)
    given = set(flags)
    deadline = time.monotonic() + RUN_SECONDS
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is None:
            return "failed", f"a hang: no end after {RUN_SECONDS} s", cmd
        # what the run started is gone within a few seconds of its end
        leftover = []
        for _ in range(100):
            leftover = processes_with_marker(marker)
            if not leftover:
                break
            time.sleep(0.05)
        result = finish(proc, marker, timeout=30)
        out = Path(flags["--output-dir"].format(dir=folder, file=folder / "a-file"))
        kind, why = verdict(result, given, leftover, out)
        return kind, why, cmd
    finally:
        processes.kill_everything_started_by(marker)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="runs to make (default 200)")
    parser.add_argument("--seed", type=int, default=1, help="the draws' seed (default 1)")
    parser.add_argument(
        "--skip", type=int, default=0, help="draw and skip this many runs first (a replay)"
    )
    parser.add_argument(
        "--cold", action="store_true", help="start every run as users do, not forked warm"
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    processes.WARM = not args.cold
    rng = random.Random(args.seed)
    counts = {script: {"trained": 0, "refused": 0, "failed": 0} for script in SCRIPTS}
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for number in range(args.skip + args.runs):
            script = rng.choice(SCRIPTS)
            flags, nproc, drawn = draw(rng, script)
            if number < args.skip:
                continue
            folder = Path(tmp) / str(number)
            folder.mkdir()
            kind, why, cmd = one_run(script, flags, nproc, folder)
            counts[script][kind] += 1
            shown = " ".join(str(c) for c in cmd).replace(PYTHON, "python")
            print(f"{number}: {kind}: {shown}" + (f"\n    {why}" if why else ""), flush=True)
            if kind == "failed":
                failures.append((number, shown, why))
    print("\n| script | trained | refused | failed |\n| --- | ---: | ---: | ---: |")
    for script, count in counts.items():
        print(f"| {script} | {count['trained']} | {count['refused']} | {count['failed']} |")
    total = {k: sum(c[k] for c in counts.values()) for k in ("trained", "refused", "failed")}
    print(
        f"\n{args.runs} runs, seed {args.seed}: {total['trained']} trained, {total['refused']}"
        f" refused with one line, {total['failed']} failed"
    )
    for number, shown, why in failures:
        print(f"\nFAILED run {number}: {why}\n  {shown}")
        print(f"  replay: python tools/fuzz_flags.py --runs 1 --seed {args.seed} --skip {number}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
