"""A loss over the whole global batch (contrastive learning's in-batch negatives, CLIP): through batches.whole_batch in
the user's compute_loss, any number of processes trains and validates what one process does, also where the ranks'
parts differ in size, and a run stopped by SIGTERM and continued what a straight run does; parts that cannot join end
every rank with one line naming the user's call; a loss over each rank's own part and batch norm without --sync-bn
are said at the start."""

from __future__ import annotations

import pytest
import torch

from processes import (
    OFFLINE,
    ends_every_rank_with,
    max_weight_difference,
    metrics,
    run_parallel,
    steps,
)
from projects import COMMON, copy_with_your_functions, launch

YOUR_PAIRS = '''
class Pairs(torch.utils.data.Dataset):
    """Pairs of views of one thing: a vector of 16 and a noisy linear image of it (an image and its caption, say)."""

    def __init__(self, size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        mixing = torch.randn(16, 16, generator=torch.Generator().manual_seed(0))
        self.a = torch.randn(size, 16, generator=generator)
        self.b = self.a @ mixing + 0.3 * torch.randn(size, 16, generator=generator)

    def __len__(self):
        return len(self.a)

    def __getitem__(self, index):
        return {"a": self.a[index], "b": self.b[index]}, 0


class TwoTowers(nn.Module):
    """An encoder for each view, normalised embeddings; CLIP's learned temperature beside them (log 10 at first)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
        self.b = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
        self.logit_scale = nn.Parameter(torch.tensor(2.3)) if LOSS == "clip" else None

    def forward(self, a, b):
        return F.normalize(self.a(a), dim=1), F.normalize(self.b(b), dim=1), self.logit_scale


def build_datasets(args):
    return Pairs(256, seed=1), Pairs(203, seed=2), 1


def build_model(args, num_classes):
    return TwoTowers()


def compute_loss(outputs, targets):
    """InfoNCE over the whole global batch: each pair's other views in the batch are its negatives."""
    preempt()
    a, b, logit_scale = outputs
    # every rank's embeddings, with their gradients: the same loss on every rank
    a, b = batches.whole_batch(a), batches.whole_batch(b)
    labels = torch.arange(len(a), device=a.device)
    if LOSS == "clip":  # CLIP's symmetric loss, its temperature learned
        logits = logit_scale.exp() * a @ b.T
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    if LOSS == "sum":  # InfoNCE as a (sum, count): the whole batch's on every rank
        return F.cross_entropy(a @ b.T / 0.1, labels, reduction="sum"), len(a)
    return F.cross_entropy(a @ b.T / 0.1, labels)


def preempt():
    """A scheduler's SIGTERM to rank 1 at its STOP_AT-th training loss (the start-up check's first)."""
    global calls
    calls += torch.is_grad_enabled()
    if os.environ.get("RANK", "0") == "1" and calls == int(os.environ.get("STOP_AT", 0)):
        os.kill(os.getpid(), signal.SIGTERM)


calls = 0
'''


def yours(loss: str) -> str:
    return (
        f"import os\nimport signal\n\nfrom extras import batches\n\nLOSS = {loss!r}\n" + YOUR_PAIRS
    )


FLAGS = [*COMMON, "--batch-size", "64", "--optimizer", "adamw", "--lr", "0.01", "--print-freq", "2"]


@pytest.mark.parametrize("loss", ["infonce", "clip"])
def test_a_loss_over_the_whole_batch_trains_and_validates_on_2_and_3_processes_what_1_does(
    tmp_path, loss
):
    """InfoNCE (temperature 0.1) and CLIP's symmetric loss with a learned temperature, each over batches.whole_batch
    of two towers' embeddings, batch 64: 2 processes (32 + 32) and 3 (22 + 21 + 21) train the weights of 1 (1e-5)
    and record its val_loss over 203 validation pairs (1e-6), its train_loss too; the loss falls. The InfoNCE run
    stopped by SIGTERM mid-epoch and continued == the straight run (1e-6), each record once; distributed_fsdp.py on
    2 processes trains what distributed.py does on 1 (1e-5)."""
    script = copy_with_your_functions("distributed.py", tmp_path / "copy", yours(loss))
    runs = {name: tmp_path / name for name in ("1", "2", "3", "stopped")}
    commands = [
        (launch(script, int(name), *FLAGS, "--output-dir", runs[name]), OFFLINE, tmp_path)
        for name in "123"
    ]
    if loss == "infonce":
        # SIGTERM at rank 1's 7th training loss: the start-up check's, then step 6 of 12 (epoch 2)
        stopped = launch(script, 2, *FLAGS, "--output-dir", runs["stopped"])
        commands.append((stopped, {**OFFLINE, "STOP_AT": "7"}, tmp_path))
        # FSDP's step takes the same call
        fsdp = copy_with_your_functions("distributed_fsdp.py", tmp_path / "fsdp-copy", yours(loss))
        commands.append(
            (launch(fsdp, 2, *FLAGS, "--output-dir", tmp_path / "fsdp"), OFFLINE, tmp_path)
        )
    run_parallel(commands, check=False)
    differences = {n: max_weight_difference(runs[n], runs["1"]) for n in "23"}
    if loss == "infonce":
        differences["FSDP on 2"] = max_weight_difference(tmp_path / "fsdp", runs["1"])
    val = {n: [m["val_loss"] for m in metrics(runs[n])] for n in "123"}
    train = {n: [r["train_loss"] for r in steps(runs[n]) if "train_loss" in r] for n in "123"}
    print(f"{loss}: 2 and 3 processes against 1: weights {differences}, val_loss {val}")
    assert max(differences.values()) <= 1e-5, differences
    for n in "23":
        assert val[n] == pytest.approx(val["1"], abs=1e-6), (n, val)
        assert train[n] == pytest.approx(train["1"], abs=1e-5), (n, train)
    assert val["1"][-1] < val["1"][0] < 4.1, val  # below ln(64) = 4.16, the untrained loss
    assert [m["val_images"] for m in metrics(runs["3"])] == [203] * 3
    if loss == "infonce":
        state = torch.load(runs["stopped"] / "checkpoint.pt", weights_only=True)
        assert (state["epoch"], 0 < state["step"] < 4) == (1, True), (state["epoch"], state["step"])
        run_parallel(
            [(launch(script, 2, *FLAGS, "--output-dir", runs["stopped"]), OFFLINE, tmp_path)]
        )
        difference = max_weight_difference(runs["stopped"], runs["2"])
        print(
            f"{loss}: stopped after step {state['step']} of epoch 2 and continued, against straight: {difference:.2g}"
        )
        assert difference <= 1e-6
        assert [r["global_step"] for r in steps(runs["stopped"])] == [
            r["global_step"] for r in steps(runs["2"])
        ]


def test_parts_that_cannot_join_end_every_rank_with_one_line_naming_the_call(tmp_path):
    """A compute_loss that gathers parts of another width on each rank: every rank ends with one line naming its call
    and the ranks' shapes, at the start-up check, not gloo's abort. With accumulation, an output that is neither a
    row per sample nor the same in every micro-batch (a batch's mean) is one line at the first step."""
    wrong = yours("infonce").replace(
        "    a, b = batches.whole_batch(a), batches.whole_batch(b)\n",
        "    a, b = batches.whole_batch(a), batches.whole_batch(b)\n"
        "    batches.whole_batch(torch.zeros(len(a), 1 + int(os.environ.get('RANK', '0'))))\n",
    )
    script = copy_with_your_functions("distributed.py", tmp_path / "copy", wrong)
    mean = yours("infonce").replace(
        "F.normalize(self.b(b), dim=1), self.logit_scale", "F.normalize(self.b(b), dim=1), a.mean()"
    )
    accum = copy_with_your_functions("distributed_grad_accum.py", tmp_path / "accum", mean)
    flags = [*FLAGS, "--accum-steps", "4", "--output-dir", tmp_path / "accum-out"]
    result, joined = run_parallel(
        [
            (launch(script, 2, *FLAGS, "--output-dir", tmp_path / "out"), OFFLINE, tmp_path),
            (launch(accum, 2, *flags), OFFLINE, tmp_path),
        ],
        check=False,
    )
    lines = script.read_text().splitlines()
    number = 1 + next(i for i, line in enumerate(lines) if "int(os.environ.get('RANK'" in line)
    ends_every_rank_with(
        result,
        f"error: whole_batch at distributed.py:{number}: the ranks' parts differ beyond their samples (dim 0):"
        " [1] float32, [2] float32",
    )
    ends_every_rank_with(
        joined,
        "error: a () tensor of the outputs is neither a row per sample nor the same in every micro-batch: a loss"
        " over the whole step cannot join it",
    )


def test_what_the_split_changes_is_said_in_one_line_at_the_start_on_2_processes(tmp_path):
    """On 2 processes, one line at the start each: InfoNCE written over the rank's own part (no
    whole_batch) names compute_loss, the towers with batch norm without --sync-bn name the layers;
    none with --sync-bn, for a (sum, count) loss over the samples, or for the main job's tiny model
    (group norm) and its default cross-entropy."""
    with_norm = yours("infonce").replace(
        "nn.Linear(16, 32), nn.Tanh()", "nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Tanh()"
    )
    own_part = yours("infonce").replace(
        "    a, b = batches.whole_batch(a), batches.whole_batch(b)\n", ""
    )
    summed = own_part.replace(
        "    return F.cross_entropy(a @ b.T / 0.1, labels)",
        "    return (a - b).square().sum(), len(a)",
    )
    tiny = ["--dataset", "fake", "--arch", "tiny", "--fake-size", "256", "--image-size", "16"]
    cases = {
        "own part": (own_part, FLAGS),
        "batch norm": (with_norm, FLAGS),
        "batch norm, --sync-bn": (with_norm, [*FLAGS, "--sync-bn"]),
        "(sum, count)": (summed, FLAGS),
        "group norm": (None, [*tiny, "--epochs", "1", "--workers", "0", "--timeout", "60"]),
    }
    commands = []
    for i, (code, flags) in enumerate(cases.values()):
        script = copy_with_your_functions("distributed.py", tmp_path / f"copy{i}", code)
        commands.append(
            (launch(script, 2, *flags, "--output-dir", tmp_path / f"out{i}"), OFFLINE, tmp_path)
        )
    said = {name: result.stdout for name, result in zip(cases, run_parallel(commands))}
    norm = (
        "batch norm (2 layers, a.1 first) normalises each rank's part of the batch: its statistics"
        " change with the number of processes; --sync-bn makes them the global batch's"
    )
    loss = (
        "compute_loss couples the samples of a batch (one sample's gradient depends on another's"
        " outputs): each rank computes it over its own part, another objective on every number of"
        " processes; batches.whole_batch over the outputs makes it the global batch's"
    )
    assert [said[name].count(norm) for name in cases] == [0, 1, 0, 0, 0], said
    assert [said[name].count(loss) for name in cases] == [1, 0, 0, 0, 0], said
    assert "batch norm (" not in said["group norm"]


def test_k_micro_batches_of_a_loss_over_the_whole_batch_train_what_one_batch_k_times_larger_does(
    tmp_path,
):
    """distributed_grad_accum.py, InfoNCE over batches.whole_batch, batch 64: --accum-steps 4 (extras/gradcache.py:
    each micro-batch's forward without gradients, the loss over the whole step, then each forward again and its rows
    of the loss's gradient) on 1 and on 2 processes trains the weights of --accum-steps 1 (1e-5) and records its
    train_loss; so do CLIP on 3 processes (micro-batches of 6 + 5 + 5), whose learned temperature is in every
    micro-batch's outputs and gets its gradient once, and InfoNCE as a (sum, count) on 3, each with SGD; 2 processes
    validate what 1 does; the second forward draws what the first drew; without the start-up checks (--no-checks),
    which find the loss over the whole batch, one line."""
    scripts = {
        loss: copy_with_your_functions("distributed_grad_accum.py", tmp_path / loss, yours(loss))
        for loss in ("infonce", "clip", "sum")
    }
    # the model's draws, in order, each with whether gradients were on
    drawing = yours("infonce").replace(
        "    def forward(self, a, b):\n",
        "    def forward(self, a, b):\n"
        "        with open(os.environ['DRAWS'], 'a') as file:\n"
        "            file.write(f'{torch.is_grad_enabled():d} {torch.rand(()).item()!r}\\n')\n",
    )
    scripts["draws"] = copy_with_your_functions(
        "distributed_grad_accum.py", tmp_path / "draws", drawing
    )
    runs = {  # name: (script, processes, K)
        "infonce 1 x 1": ("infonce", 1, 1),
        "infonce 1 x 4": ("infonce", 1, 4),
        "infonce 2 x 4": ("infonce", 2, 4),
        "clip 1 x 1": ("clip", 1, 1),
        "clip 3 x 4": ("clip", 3, 4),
        "sgd 1 x 1": ("infonce", 1, 1),
        "sum 3 x 4": ("sum", 3, 4),
        "draws": ("draws", 1, 4),
    }
    draws = tmp_path / "draws.txt"
    commands = [
        (
            launch(
                scripts[loss], n, *FLAGS, "--accum-steps", str(k), "--output-dir", tmp_path / name
            ),
            {**OFFLINE, "DRAWS": str(draws)},
            tmp_path,
        )
        for name, (loss, n, k) in runs.items()
    ]
    commands[-1][0].extend(["--epochs", "1"])
    # SGD: a temperature's gradient taken K times would show, and a (sum, count) divided by
    # another count (AdamW's steps would not change with the gradient's scale)
    for command in commands[3:7]:
        command[0].extend(["--optimizer", "sgd", "--lr", "0.01"])
    # without the start-up step, which finds the loss over the whole batch: one line, not a step over each
    # micro-batch's part
    unchecked = launch(scripts["infonce"], 2, *FLAGS, "--accum-steps", "4", "--no-checks")
    commands.append((unchecked + ["--output-dir", tmp_path / "unchecked"], OFFLINE, tmp_path))
    results = run_parallel(commands, check=False)
    assert all(result.returncode == 0 for result in results[:-1]), [r.stderr for r in results]
    assert results[-1].returncode != 0, results[-1].stderr
    assert (
        "error: compute_loss calls batches.whole_batch, which the start-up checks find"
        " (extras/checks.py): leave out --no-checks" in results[-1].stderr
    ), results[-1].stderr
    # each against --accum-steps 1 on 1 process with the same optimizer (InfoNCE's, for its (sum, count))
    baseline = {
        "infonce 1 x 4": "infonce 1 x 1",
        "infonce 2 x 4": "infonce 1 x 1",
        "clip 3 x 4": "clip 1 x 1",
        "sum 3 x 4": "sgd 1 x 1",
    }
    differences = {
        name: max_weight_difference(tmp_path / name, tmp_path / before)
        for name, before in baseline.items()
    }
    train = {
        name: [r["train_loss"] for r in steps(tmp_path / name) if "train_loss" in r]
        for name in runs
    }
    val = {name: [m["val_loss"] for m in metrics(tmp_path / name)] for name in runs}
    print(f"--accum-steps 4 against 1: weights {differences}, val_loss {val}")
    assert max(differences.values()) <= 1e-5, differences
    for name in differences:
        assert train[name] == pytest.approx(train[baseline[name]], abs=1e-5), (name, train)
    assert val["infonce 2 x 4"] == pytest.approx(val["infonce 1 x 4"], abs=1e-6), val
    assert val["infonce 1 x 4"][-1] < val["infonce 1 x 4"][0], val
    # each step: 4 forwards without gradients, then 4 with, drawing the same 4 numbers
    lines = [line.split() for line in draws.read_text().splitlines()]
    steps_drawn = [
        (lines[i : i + 4], lines[i + 4 : i + 8])
        for i in range(len(lines) - 7)
        if [grad for grad, _ in lines[i : i + 8]] == ["0"] * 4 + ["1"] * 4
    ]
    assert len(steps_drawn) == 256 // 64, lines
    for first, again in steps_drawn:
        assert [x for _, x in first] == [x for _, x in again] and len({x for _, x in first}) == 4
