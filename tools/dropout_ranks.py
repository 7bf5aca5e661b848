"""Dropout on 2 processes learns as well as on 1: pytorch/examples' MNIST Net (two convolutions, a
max-pool, dropout 0.25 and 0.5, two linear layers), its shape taken as it is into distributed.py's
four functions for 8 x 8 digits, on learnable synthetic digits (a stroke pattern per class, shifted
by up to a pixel, plus noise); the same global batch on 1 and 2 processes, a few seeds each. Each
rank draws its own dropout masks; the two are equal in distribution, not bit for bit, so this is a
benchmark-style check: the mean validation accuracy of each, and each seed's.

    python tools/dropout_ranks.py            # 3 seeds, about 3 minutes on 2 CPU cores
    python tools/dropout_ranks.py --seeds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from benchmark import hardware
from processes import metrics, python, run_parallel, torchrun
from projects import copy_with_your_functions

YOUR_DIGITS = '''
class Digits(torch.utils.data.Dataset):
    """8 x 8 greyscale digits: a stroke pattern per class, shifted by up to a pixel, plus noise."""

    def __init__(self, size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        strokes = (torch.rand(10, 1, 8, 8, generator=torch.Generator().manual_seed(0)) < 0.35).float()
        self.labels = torch.randint(0, 10, (size,), generator=generator)
        shifts = torch.randint(-1, 2, (size, 2), generator=generator)
        images = torch.stack(
            [strokes[y].roll(tuple(s.tolist()), dims=(1, 2)) for y, s in zip(self.labels, shifts)]
        )
        self.images = images + 0.4 * torch.randn(size, 1, 8, 8, generator=generator)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index], int(self.labels[index])


class Net(nn.Module):
    """pytorch/examples' MNIST Net, its fc1 sized for 8 x 8 inputs."""

    def __init__(self, num_classes):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(256, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = self.dropout1(F.max_pool2d(x, 2).flatten(1))
        x = self.dropout2(F.relu(self.fc1(x)))
        return self.fc2(x)


def build_datasets(args):
    return Digits(3200, seed=1), Digits(800, seed=2), 10


def build_model(args, num_classes):
    return Net(num_classes)


def compute_loss(outputs, targets):
    return F.cross_entropy(outputs, targets)
'''
FLAGS = [
    "--batch-size",
    "64",
    "--epochs",
    "4",
    "--lr",
    "0.05",
    "--workers",
    "0",
    "--timeout",
    "120",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds for each world size")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="dropout-ranks-"))
    script = copy_with_your_functions("distributed.py", base / "copy", YOUR_DIGITS)
    runs = []
    for seed in range(args.seeds):
        for processes in (1, 2):
            out = base / f"p{processes}-s{seed}"
            flags = [*FLAGS, "--seed", seed, "--output-dir", out]
            command = python(script, *flags) if processes == 1 else torchrun(2, script, *flags)
            runs.append(((processes, seed, out), (command, {}, base)))
    # one run at a time beside another: 2 cores
    run_parallel([command for _, command in runs], timeout=900, at_once=2)
    accuracy = {1: [], 2: []}
    for (processes, seed, out), _ in runs:
        accuracy[processes].append(metrics(out)[-1]["val_acc"])
    print(f"{hardware()}, {args.seeds} seeds, distributed.py {' '.join(map(str, FLAGS))}")
    print("| processes | val_acc, mean | each seed |")
    print("| ---: | ---: | --- |")
    for processes, values in accuracy.items():
        each = ", ".join(f"{v:.3f}" for v in values)
        print(f"| {processes} | {statistics.mean(values):.3f} | {each} |")
    gap = statistics.mean(accuracy[2]) - statistics.mean(accuracy[1])
    print(f"2 processes - 1 process: {gap:+.3f}")
    sys.exit(0 if abs(gap) <= 0.02 else 1)


if __name__ == "__main__":
    main()
