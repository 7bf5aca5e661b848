"""DiLoCo's outer optimizer, rule against rule, beside DDP: how each ends a short, a middling and a long run.
distributed_diloco.py with H = 8 on 2 processes (torchrun), 2 seeds each, on
- the README's main job (ResNet-18, SGD, fake images): 6 outer steps, and 24 (12 epochs);
- a 2-layer GPT-2 with AdamW on counting sequences (tests/test_fsdp.py's): 6, 24 and 200 outer steps.
Rules: DiLoCo's Nesterov 0.7 / 0.9, a constant 0.7 / 0.5, plain averaging (outer lr 1, no momentum), the script's
default (Nesterov lr 0.7, momentum min(0.9, (t - 1) / (t + 2)) at outer step t) and schedule-free SGD (lr 2, beta
0.2; Khaled et al., 2025), which this file adds to a copy of the script. Prints one markdown table.

    python tests/outer_rules.py                 # everything (about an hour on 2 CPU cores)
    python tests/outer_rules.py --tasks gpt2-6  # some rows
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from benchmark import hardware
from processes import metrics, run_parallel, torchrun
from test_fsdp import YOUR_LANGUAGE_MODEL
from test_your_own_data import copy_with_your_functions

MAIN_JOB = [
    "--dataset",
    "fake",
    "--fake-size",
    "1024",
    "--image-size",
    "16",
    "--arch",
    "resnet18",
    "--batch-size",
    "64",
    "--ema",
    "0.9",
    "--workers",
    "0",
]  # the README's: 16 steps an epoch
GPT2 = ["--batch-size", "32", "--optimizer", "adamw", "--lr", "1e-2", "--workers", "0"]
# 2048 sequences of counting: 64 steps of 32 an epoch
COUNTING = YOUR_LANGUAGE_MODEL.replace("Progressions(640, seed=1)", "Progressions(2048, seed=1)")
# name: (the copy's user code, None for the script's own; its flags; the number it ends at)
TASKS = {
    "main-6": (None, [*MAIN_JOB, "--epochs", "3"], "val_acc"),
    "main-24": (None, [*MAIN_JOB, "--epochs", "12"], "val_acc"),
    "gpt2-6": (COUNTING, [*GPT2, "--epochs", "1", "--steps-per-epoch", "48"], "val_loss"),
    "gpt2-24": (COUNTING, [*GPT2, "--epochs", "3"], "val_loss"),
    "gpt2-200": (COUNTING, [*GPT2, "--epochs", "25"], "val_loss"),
}
H = ["--inner-steps", "8"]
RULES = {
    "DDP": ("distributed.py", []),
    "0.7 / 0.9 (DiLoCo's)": ("distributed_diloco.py", [*H, "--outer-momentum", "0.9"]),
    "0.7 / 0.5": ("distributed_diloco.py", [*H, "--outer-momentum", "0.5"]),
    "averaging (1 / 0)": (
        "distributed_diloco.py",
        [*H, "--outer-lr", "1", "--outer-momentum", "0"],
    ),
    "0.7 / rising (default)": ("distributed_diloco.py", H),
    "schedule-free 2 / 0.2": ("schedule_free.py", [*H, "--outer-lr", "2"]),
}

SCHEDULE_FREE = '''

class ScheduleFree(DiLoCo):
    """Schedule-free SGD as the outer optimizer (Defazio et al., 2024), beta 0.2: z takes the copies' mean move
    (made from y) as its gradient, x is the mean of the z so far, and the copies start from y = (1 - beta) z +
    beta x; validation and the checkpoint hold x."""

    beta = 0.2

    def __init__(self, model, args, world_size):
        super().__init__(model, args, world_size)
        self.z = [s.clone() for s in self.synced]
        self.x = [s.clone() for s in self.synced]

    @torch.no_grad()
    def update(self, grads):
        self.outer_steps += 1
        for y, z, x, grad in zip(self.synced, self.z, self.x, grads):
            z.sub_(grad, alpha=self.lr)
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


DiLoCo = ScheduleFree
'''


def copies(tmp: Path, task: str) -> Path:
    """The folder with the scripts a task runs: its user code in each, and schedule_free.py."""
    folder = tmp / task
    code = TASKS[task][0]
    for script in ("distributed.py", "distributed_diloco.py"):
        copy_with_your_functions(script, folder, code)
    source = (folder / "distributed_diloco.py").read_text()
    main_guard = '\n\nif __name__ == "__main__":'
    assert source.count(main_guard) == 1
    (folder / "schedule_free.py").write_text(source.replace(main_guard, SCHEDULE_FREE + main_guard))
    return folder


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
            commands = [
                (
                    torchrun(2, RULES[rule][0], *flags, *RULES[rule][1], "--seed", str(seed))
                    + [
                        "--output-dir",
                        folder / f"{rule}-{seed}".replace(" ", "_").replace("/", ""),
                    ],
                    None,
                    folder,
                )
                for rule, seed in cells
            ]
            results = run_parallel(commands, timeout=3600, at_once=args.at_once)
            for (rule, seed), (command, *_), result in zip(cells, commands, results):
                ended = metrics(Path(command[-1]))[-1][key]
                table.setdefault((task, rule), []).append(ended)
                print(f"{task} {rule} seed {seed}: {key} {ended:.4f}", flush=True)
    print("\n| run, outer steps | " + " | ".join(args.rules) + " |")
    print("| --- |" + " ---: |" * len(args.rules))
    for task in args.tasks:
        key = TASKS[task][2]
        cells = [table[task, rule] for rule in args.rules]
        row = " | ".join(
            f"{statistics.mean(c):.3f} ({', '.join(f'{v:.3f}' for v in c)})" for c in cells
        )
        print(f"| {task.replace('-', ', ')}: {key} | {row} |")
    print(
        f"\nHardware: {hardware()}.\nCommand: python tests/outer_rules.py {shlex.join(sys.argv[1:])}"
    )


if __name__ == "__main__":
    main()
