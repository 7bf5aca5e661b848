"""Randomness as one process has it: a user's random transforms (torchvision's own, in a worker or
not) are drawn per sample from (seed, epoch, index), so 2 processes train what 1 does with them;
dropout is drawn independently on every rank; a run stopped and continued on the same number of
processes equals the straight one with both, and --seed reaches the workers."""

from __future__ import annotations

import re
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from processes import (
    assert_same_records,
    max_weight_difference,
    metrics,
    run,
    run_parallel,
    steps,
)
from projects import copy_with_your_functions, launch
from extras import seeds

# a user's Dataset with torchvision's random transforms on small random images; each training
# sample's draws are logged by the process that read it, a worker or a rank: the transformed
# image's sum (a fingerprint of its crop and flip) and the next number its random stream gives
YOUR_RANDOM_CROPS = '''
import os
import signal

from torchvision.transforms import v2 as T


class RandomCrops(torch.utils.data.Dataset):
    """3x12x12 float images around one centre per class, cropped and flipped at random."""

    def __init__(self, size: int, seed: int, log: str | None = None):
        generator = torch.Generator().manual_seed(seed)
        centres = torch.randn(4, 3, 12, 12, generator=torch.Generator().manual_seed(0))
        self.labels = torch.randint(0, 4, (size,), generator=generator)
        self.images = centres[self.labels] + torch.randn(size, 3, 12, 12, generator=generator)
        self.transform = T.Compose(
            [T.RandomResizedCrop(8, scale=(0.3, 1.0), antialias=True), T.RandomHorizontalFlip()]
        )
        self.log = log

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = self.transform(self.images[index])
        if self.log:
            with open(os.path.join(self.log, f"draws-{os.getpid()}.txt"), "a") as f:
                f.write(f"{index} {image.sum().item()!r} {torch.rand(()).item()!r}\\n")
        return image, int(self.labels[index])


def build_datasets(args):
    return RandomCrops(640, 1, args.output_dir), RandomCrops(203, 2), 4


def build_model(args, num_classes):
    return nn.Sequential(
        nn.Flatten(), nn.Linear(192, 32), nn.Tanh(), nn.Dropout(DROPOUT), nn.Linear(32, num_classes)
    )


def compute_loss(outputs, targets):
    # a preemption at the STOP_AT-th call of rank 1, as a scheduler's SIGTERM
    global calls
    calls += 1
    if os.environ.get("RANK", "0") == "1" and calls == int(os.environ.get("STOP_AT", 0)):
        os.kill(os.getpid(), signal.SIGTERM)
    if PROBE:  # the same input, in training mode, on every rank: what its dropout makes of it
        with torch.no_grad(), open(os.path.join(PROBE, f"probe-{os.environ.get('RANK', '0')}.txt"), "a") as f:
            f.write(f"{MODEL[0].training} {MODEL[0](torch.ones(1, 3, 8, 8)).tolist()}\\n")
    return F.cross_entropy(outputs, targets)


calls = 0
'''


def your_code(dropout: float = 0.0, probe: Path | None = None) -> str:
    """The user's four functions; with dropout in the model, and probe: a folder where every
    training-mode loss also logs the model's output for one fixed input, by rank."""
    code = YOUR_RANDOM_CROPS + f"DROPOUT = {dropout}\nPROBE = {str(probe) if probe else None!r}\n"
    if probe:
        # the model as built, for the probe
        code = code.replace(
            "def build_model(args, num_classes):\n    return nn.Sequential(",
            "def build_model(args, num_classes):\n    MODEL[0] = nn.Sequential(",
        )
        code = code.replace(
            "nn.Linear(32, num_classes)\n    )\n",
            "nn.Linear(32, num_classes)\n    )\n    return MODEL[0]\n\n\nMODEL = [None]\n",
        )
    return code


FLAGS = ["--batch-size", "32", "--epochs", "2", "--lr", "0.05", "--timeout", "60"]


def draws(output_dir: Path) -> set[tuple[int, float, float]]:
    """Every (index, image sum, next draw) that the run's processes logged."""
    logged = set()
    for path in Path(output_dir).glob("draws-*.txt"):
        for line in path.read_text().splitlines():
            index, image, after = line.split()
            logged.add((int(index), float(image), float(after)))
    return logged


def test_random_transforms_train_on_2_processes_with_workers_what_1_trains(tmp_path):
    """torchvision's RandomResizedCrop and RandomHorizontalFlip in a user's Dataset: 2 processes
    with 2 workers each train the weights of 1 process without workers, each sample drawn alike;
    another --seed draws other crops."""
    script = copy_with_your_functions("distributed.py", tmp_path / "copy", your_code())
    runs = {
        "one": (1, "0", "0"),
        "two": (2, "2", "0"),
        "other seed": (1, "0", "1"),
    }
    run_parallel(
        [
            (
                launch(
                    script, n, *FLAGS, "--workers", w, "--seed", s, "--output-dir", tmp_path / k
                ),
                {},
                tmp_path,
            )
            for k, (n, w, s) in runs.items()
        ],
        timeout=240,
    )
    one, two, other = (draws(tmp_path / name) for name in runs)
    difference = max_weight_difference(tmp_path / "one", tmp_path / "two")
    print(f"random crops, 1 process vs 2 x 2 workers: max weight difference {difference:.1e}")
    assert difference <= 1e-5
    # each sample drew its crop and flip alike, wherever it was read, and anew each epoch
    assert one == two
    by_index = defaultdict(set)
    for index, _, after in one:
        by_index[index].add(after)
    assert len(by_index) == 640 and all(len(epochs) == 2 for epochs in by_index.values())
    # no two samples' streams alike: worker k of every rank once drew what worker k of rank 0 drew
    assert len({after for *_, after in two}) == len(two) == 2 * 640
    # another seed: other streams for every sample, other crops for nearly every one (12 x 12
    # images have few crop boxes)
    assert not {(index, after) for index, _, after in one} & {(i, a) for i, _, a in other}
    assert len({draw[:2] for draw in one} & {draw[:2] for draw in other}) < len(one) / 20
    assert max_weight_difference(tmp_path / "one", tmp_path / "other seed") > 1e-3


@pytest.mark.parametrize(
    "script, flags",
    [
        ("distributed.py", []),
        ("distributed_grad_accum.py", ["--accum-steps", "2"]),
        ("distributed_fsdp.py", []),
        ("distributed_diloco.py", ["--inner-steps", "4"]),
    ],
)
def test_dropout_draws_its_own_masks_on_every_rank(script, flags, tmp_path):
    """A model with dropout: the same input gives other training-mode outputs on rank 0 and rank 1
    at every step (the scripts once seeded every rank alike), and the same in eval mode."""
    probe = tmp_path / "probe"
    probe.mkdir()
    copy = copy_with_your_functions(script, tmp_path / "copy", your_code(0.5, probe))
    out = tmp_path / "out"
    run(launch(copy, 2, *FLAGS, *flags, "--epochs", "1", "--workers", "0", "--output-dir", out))
    lines = [(probe / f"probe-{r}.txt").read_text().splitlines() for r in (0, 1)]
    assert len(lines[0]) == len(lines[1])
    # the start-up step, taken and undone before training: the same weights and streams on both
    assert lines[0][0] == lines[1][0]
    pairs = list(zip(*lines))[1:]
    training = [(a, b) for a, b in pairs if a.startswith("True")]
    assert len(training) >= 20 and all(a != b for a, b in training), training
    # validation, in eval mode: no dropout, the same outputs on both ranks
    evaluation = [(a, b) for a, b in pairs if a.startswith("False")]
    assert len(evaluation) >= 4 and all(a == b for a, b in evaluation), evaluation


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_stopped_run_with_dropout_and_random_transforms_continues_exactly(workers, tmp_path):
    """Dropout and a user's random transforms (read in the rank's own process, or in workers):
    stopped by SIGTERM on rank 1 in the middle of epoch 2 and continued with the same command on 2
    processes, the run equals the straight one exactly; continued on 1 process it trains on and
    says that its dropout is now drawn by 1 rank."""
    script = copy_with_your_functions("distributed.py", tmp_path / "copy", your_code(0.3))
    flags = [*FLAGS, "--workers", workers, "--print-freq", "5"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    # rank 1's compute_loss: the start-up step, 20 steps and 7 validation batches in epoch 1
    results = run_parallel(
        [
            (launch(script, 2, *flags, "--output-dir", straight), {}, tmp_path),
            (launch(script, 2, *flags, "--output-dir", stopped), {"STOP_AT": "33"}, tmp_path),
        ],
        timeout=240,
        check=False,
    )
    assert results[0].returncode == 0, results[0].stderr
    step = int(
        re.search(r"stopped by SIGTERM after step (\d+)/20 of epoch 2", results[1].stderr)[1]
    )
    on_one = tmp_path / "on one"
    shutil.copytree(stopped, on_one)
    continued = run_parallel(
        [
            (launch(script, 2, *flags, "--output-dir", stopped), {}, tmp_path),
            (launch(script, 1, *flags, "--output-dir", on_one), {}, tmp_path),
        ],
        timeout=240,
    )
    assert f"1 of 2 epochs done and {step} steps of the next" in continued[0].stdout
    assert "dropout" not in continued[0].stdout  # the same world size: the same draws
    difference = max_weight_difference(stopped, straight)
    print(f"--workers {workers}: continued vs straight, max weight difference {difference:.1e}")
    assert difference == 0
    assert_same_records(steps(stopped), steps(straight), tolerance=0)
    said = continued[1].stdout
    assert (
        "randomness inside the model (dropout) is drawn per rank from here (1 of them, 2 before)"
        in said
    )
    # it trains on: as the straight run ends, within what other dropout masks make of 203 images
    accuracies = [metrics(out)[-1]["val_acc"] for out in (on_one, straight)]
    print(
        f"validation accuracy continued on 1 process {accuracies[0]:.3f}, straight {accuracies[1]:.3f}"
    )
    assert [m["epoch"] for m in metrics(on_one)] == [1, 2]
    assert abs(accuracies[0] - accuracies[1]) <= 0.05 and accuracies[0] > 0.8


def test_each_sample_draws_from_its_seed_epoch_and_index_and_the_model_stream_is_kept():
    """In a rank's own process the sample's draws come from (seed, epoch, index), and the global
    torch stream (the model's: dropout) is as it was; a stream's samples from their place."""

    class Draws(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, index):
            return torch.rand(()).item()

    dataset = seeds.per_sample(Draws(), seed=3)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    first = [dataset[i] for i in range(10)]
    assert torch.equal(torch.get_rng_state(), before)
    assert [dataset[i] for i in reversed(range(10))] == first[::-1]
    assert len(set(first)) == 10
    dataset.set_epoch(1)
    assert all(a != b for a, b in zip(first, [dataset[i] for i in range(10)]))
    assert seeds.per_sample(Draws(), seed=4)[0] != first[0]
    stream = list(seeds.sample_streams(iter(range(3)), 3, "stream", 0, 0))
    assert stream == [0, 1, 2] and torch.equal(torch.get_rng_state(), before)
