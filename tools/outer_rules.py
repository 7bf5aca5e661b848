"""DiLoCo's outer optimizer, rule against rule, beside DDP: how each ends a short, a middling and a long run.
distributed_diloco.py with H = 8 on 2 processes (torchrun), 2 seeds each, on
- the README's main job (ResNet-18, SGD, fake images): 6 outer steps, and 24 (12 epochs);
- a 2-layer GPT-2 with AdamW on counting sequences (tests/test_fsdp.py's): 6, 24 and 200 outer steps.
Rules: Nesterov SGD at DiLoCo's lr 0.7 and momentum 0.9, at 0.7 / 0.5 (the script's default), plain averaging (outer
lr 1, no momentum); and two this file adds to a copy of the script: a momentum rising from none, min(0.9, (t - 1) /
(t + 2)) at outer step t, and schedule-free SGD (lr 2, beta 0.2; Khaled et al., 2025). Prints each run's end and a
markdown table of the means (each seed's in brackets).

    python tools/outer_rules.py                 # everything: over an hour on 2 CPU cores (docs/many-machines.md)
    python tools/outer_rules.py --tasks gpt2-6  # some rows
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from benchmark import hardware
from processes import README_JOB, metrics, run_parallel, torchrun
from projects import YOUR_LANGUAGE_MODEL
from projects import copy_with_your_functions

GPT2 = ["--batch-size", "32", "--optimizer", "adamw", "--lr", "1e-2", "--workers", "0"]
# 2048 sequences of counting: 64 steps of 32 an epoch
COUNTING = YOUR_LANGUAGE_MODEL.replace("Progressions(640, seed=1)", "Progressions(2048, seed=1)")
# name: (the copy's user code, None for the script's own; its flags; the number it ends at)
TASKS = {
    "main-6": (None, [*README_JOB, "--epochs", "3"], "val_acc"),
    "main-24": (None, [*README_JOB, "--epochs", "12"], "val_acc"),
    "gpt2-6": (COUNTING, [*GPT2, "--epochs", "1", "--steps-per-epoch", "48"], "val_loss"),
    "gpt2-24": (COUNTING, [*GPT2, "--epochs", "3"], "val_loss"),
    "gpt2-200": (COUNTING, [*GPT2, "--epochs", "25"], "val_loss"),
}
H = ["--inner-steps", "8"]
RULES = {
    "DDP": ("distributed.py", []),
    "DiLoCo's 0.7 / 0.9": ("distributed_diloco.py", [*H, "--outer-momentum", "0.9"]),
    "0.7 / 0.5 (the default)": ("distributed_diloco.py", H),
    "averaging 1 / 0": ("distributed_diloco.py", [*H, "--outer-lr", "1", "--outer-momentum", "0"]),
    # the variants this file adds to a copy of the script
    "0.7 / rising": ("variants.py", H, {"OUTER": "rising"}),
    "schedule-free 2 / 0.2": ("variants.py", [*H, "--outer-lr", "2"], {"OUTER": "schedule-free"}),
}

VARIANTS = '''

class ScheduleFree(DiLoCo):
    """Schedule-free SGD as the outer optimizer (Defazio et al., 2024), beta 0.2: z takes the copies' mean move
    (made from y) as its gradient, x is the mean of the z so far, and the copies start from y = (1 - beta) z +
    beta x; validation and the checkpoint hold x."""

    beta = 0.2

    def __init__(self, model, args, world_size):
        super().__init__(model, args, world_size)
        self.z = [s.clone() for s in self.synced]
        self.x = [s.clone() for s in self.synced]
        self.outer_steps = 0

    @torch.no_grad()
    def update(self, grads):
        self.outer_steps += 1
        for y, z, x, grad in zip(self.synced, self.z, self.x, grads):
            z.sub_(grad, alpha=self.optimizer.param_groups[0]["lr"])
            x.lerp_(z, 1 / (self.outer_steps + 1))
            y.copy_(torch.lerp(z, x, self.beta))

    @contextlib.contextmanager
    def synchronised(self):
        y, self.synced = self.synced, self.x
        try:
            with super().synchronised():
                yield
        finally:
            self.synced = y


class Rising(DiLoCo):
    """Nesterov momentum min(0.9, (t - 1) / (t + 2)) at outer step t: none at the first (the mean move times the
    outer lr), 0.5 at the fourth, 0.9 from the 28th."""

    def __init__(self, model, args, world_size):
        super().__init__(model, args, world_size)
        self.velocity = [torch.zeros_like(s) for s in self.synced]
        self.outer_steps = 0

    @torch.no_grad()
    def update(self, grads):
        self.outer_steps += 1
        momentum = min(0.9, (self.outer_steps - 1) / (self.outer_steps + 2))
        for synced, grad, velocity in zip(self.synced, grads, self.velocity):
            velocity.mul_(momentum).add_(grad)
            synced.sub_(grad.add(velocity, alpha=momentum), alpha=self.optimizer.param_groups[0]["lr"])


DiLoCo = {"schedule-free": ScheduleFree, "rising": Rising}[os.environ["OUTER"]]
'''


def copies(tmp: Path, task: str) -> Path:
    """The folder with the scripts a task runs: its user code in each, and variants.py."""
    folder = tmp / task
    code = TASKS[task][0]
    for script in ("distributed.py", "distributed_diloco.py"):
        copy_with_your_functions(script, folder, code)
    source = (folder / "distributed_diloco.py").read_text()
    main_guard = '\n\nif __name__ == "__main__":'
    assert source.count(main_guard) == 1
    (folder / "variants.py").write_text(source.replace(main_guard, VARIANTS + main_guard))
    return folder


def cell(ends: list[float], ddp: list[float] | None, key: str) -> str:
    """The mean of the seeds' ends; a loss also as a multiple of DDP's; each seed's in brackets."""
    text = f"{statistics.mean(ends):.3f}"
    if key == "val_loss" and ddp:
        text += f" = {statistics.mean(ends) / statistics.mean(ddp):.2f}x"
    return text + f" ({', '.join(f'{v:.3f}' for v in ends)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tasks", nargs="+", default=list(TASKS), choices=list(TASKS), help="the rows"
    )
    parser.add_argument(
        "--rules", nargs="+", default=list(RULES), choices=list(RULES), help="the columns"
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1], help="each cell's mean is of these"
    )
    parser.add_argument(
        "--at-once", type=int, default=2, help="runs at a time (of 2 processes each)"
    )
    args = parser.parse_args()
    table = {}
    with tempfile.TemporaryDirectory() as tmp:
        for task in args.tasks:
            folder = copies(Path(tmp), task)
            _, flags, key = TASKS[task]
            cells = [(rule, seed) for rule in args.rules for seed in args.seeds]
            commands = []
            for rule, seed in cells:
                script, rule_flags, *env = RULES[rule]
                out = folder / f"{rule}-{seed}".replace(" ", "_").replace("/", "")
                command = torchrun(2, script, *flags, *rule_flags, "--seed", str(seed))
                env = (env or [None])[0]
                commands.append((command + ["--output-dir", out], env, folder))
            run_parallel(commands, timeout=3600, at_once=args.at_once)
            for (rule, seed), (command, *_) in zip(cells, commands):
                ended = metrics(Path(command[-1]))[-1][key]
                table.setdefault((task, rule), []).append(ended)
                print(f"{task} {rule} seed {seed}: {key} {ended:.4f}", flush=True)
    print("\n| run, outer steps | " + " | ".join(args.rules) + " |")
    print("| --- |" + " ---: |" * len(args.rules))
    for task in args.tasks:
        key = TASKS[task][2]
        row = [cell(table[task, rule], table.get((task, "DDP")), key) for rule in args.rules]
        print(f"| {task.replace('-', ', ')}: {key} | {' | '.join(row)} |")
    print(
        f"\nHardware: {hardware()}.\nCommand: python tools/outer_rules.py {shlex.join(sys.argv[1:])}"
    )


if __name__ == "__main__":
    main()
