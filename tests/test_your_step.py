"""A step of the user's own (train_step at the top of a copy of distributed.py, beside the plug points) keeps what
the loop around it guarantees: 2 processes with batch B train what 1 process does with 2B, a run stopped and
continued what a straight run does, each step's record once; a frozen model beside the trained one (build_frozen)
is in no optimizer and no saved file."""

from __future__ import annotations

import ast
import json

import pytest
import torch

import utils
from processes import OFFLINE, ROOT, max_weight_difference, metrics, run_parallel, steps
from projects import COMMON, YOUR_CLASSIFICATION, copy_with_your_functions, launch, users_code

YOUR_DENOISING = '''
class Vectors(torch.utils.data.Dataset):
    """Vectors of 16 on a plane of 4; each sample is its own target (the clean vector to reconstruct)."""

    def __init__(self, size: int, seed: int):
        basis = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
        self.x = torch.randn(size, 4, generator=torch.Generator().manual_seed(seed)) @ basis

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.x[index]


def build_datasets(args):
    return Vectors(512, seed=1), Vectors(203, seed=2), 16


def build_model(args, num_classes):
    return nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 16))


def compute_loss(outputs, targets):
    return F.mse_loss(outputs, targets)


def train_step(run, inputs, targets) -> dict:
    """A denoising autoencoder: the inputs corrupted, the clean ones reconstructed."""
    model, optimizer = run.model, run.optimizer
    # each sample corrupted by its own values: alike on any number of processes
    noisy = inputs + 0.5 * torch.sin(3 * inputs)
    outputs = model(noisy)
    loss = compute_loss(outputs, inputs)  # the loss reads the inputs
    optimizer.zero_grad(set_to_none=True)
    run.backward(loss)
    optimizer.step()
    run.scheduler.step()
    return dict(loss=loss, outputs=outputs, corruption=(noisy - inputs).pow(2).mean())


def eval_step(run, model, inputs, targets):
    """Validated as trained: the corrupted inputs reconstructed."""
    outputs = model(inputs + 0.5 * torch.sin(3 * inputs))
    return compute_loss(outputs, inputs), outputs
'''

# the same step over distributed_grad_accum.py's micro-batches
YOUR_DENOISING_IN_MICRO_BATCHES = (
    YOUR_DENOISING.split("def train_step")[0]
    + """
def train_step(run, micro_batches) -> dict:
    model, optimizer = run.model, run.optimizer
    optimizer.zero_grad(set_to_none=True)
    corruption = 0
    for i, (inputs, targets, samples) in enumerate(micro_batches, 1):
        with nullcontext() if i == run.args.accum_steps else model.no_sync():
            noisy = inputs + 0.5 * torch.sin(3 * inputs)
            outputs = model(noisy)
            loss = compute_loss(outputs, inputs)
            run.backward(loss, samples)
        run.recorder.meter.update(loss, outputs, targets, samples)
        corruption = corruption + (noisy - inputs).pow(2).mean() * samples / run.args.batch_size
    optimizer.step()
    run.scheduler.step()
    return dict(grad_norm=None, corruption=corruption * dist.get_world_size())
"""
)


def test_a_denoising_step_of_yours_trains_on_2_processes_what_1_does_and_continues_exactly(
    tmp_path,
):
    """The user's train_step corrupts the inputs and reconstructs them, and their eval_step validates so: 2 x 16 ==
    1 x 32 (1e-5), a run stopped after its first epoch and continued == the straight run, each step's record once,
    the validation loss the eval_step's over every sample once (1e-5), falling below a third of the untrained one. The same step over distributed_grad_accum.py's 2 micro-batches on 2
    processes trains the same weights; the step's other number (the corruption) is recorded alike by both."""
    script = copy_with_your_functions("distributed.py", tmp_path / "copy", YOUR_DENOISING)
    accumulated = copy_with_your_functions(
        "distributed_grad_accum.py", tmp_path / "accum", YOUR_DENOISING_IN_MICRO_BATCHES
    )
    flags = [*COMMON, "--print-freq", "4", "--optimizer", "adamw", "--lr", "0.03"]
    runs = {
        "one": launch(script, 1, *flags, "--output-dir", tmp_path / "one"),
        "two": launch(script, 2, *flags, "--output-dir", tmp_path / "two"),
        "stopped": launch(
            script, 2, *flags, "--stop-after", "1", "--output-dir", tmp_path / "stopped"
        ),
        "accumulated": launch(
            accumulated, 2, *flags, "--accum-steps", "2", "--output-dir", tmp_path / "accumulated"
        ),
    }
    run_parallel([(cmd, OFFLINE, tmp_path) for cmd in runs.values()])
    continued = launch(script, 2, *flags, "--output-dir", tmp_path / "stopped")
    run_parallel([(continued, OFFLINE, tmp_path)])
    one, two, stopped, accumulated = (tmp_path / name for name in runs)
    differences = [
        max_weight_difference(two, one),
        max_weight_difference(stopped, two),
        max_weight_difference(accumulated, one),
    ]
    print(
        f"denoising: 2 x 16 against 1 x 32 {differences[0]:.2g}, continued {differences[1]:.2g},"
        f" 2 x 2 micro-batches of 8 against 1 x 32 {differences[2]:.2g}"
    )
    assert differences[0] <= 1e-5 and differences[1] <= 1e-6 and differences[2] <= 1e-5, differences
    corruption = {
        out: [r["train_corruption"] for r in steps(out) if "train_loss" in r]
        for out in (one, accumulated)
    }
    assert (
        corruption[accumulated] == pytest.approx(corruption[one], rel=1e-5) and corruption[one]
    ), corruption
    losses = [m["val_loss"] for m in metrics(two)]
    # below a third of what predicting 0 scores: the validation set's mean square
    untrained = users_code(YOUR_DENOISING)["Vectors"](203, seed=2).x.pow(2).mean().item()
    assert losses == sorted(losses, reverse=True) and losses[-1] < untrained / 3, (
        losses,
        untrained,
    )
    assert [m["val_images"] for m in metrics(two)] == [203] * 3  # each validation sample once
    # the user's eval_step's loss, over every validation sample once: the final weights' on the corrupted inputs
    yours = users_code(YOUR_DENOISING)
    model = yours["build_model"](None, 16).double()
    model.load_state_dict(torch.load(two / "checkpoint.pt", weights_only=True)["model"])
    clean = yours["Vectors"](203, seed=2).x.double()
    with torch.no_grad():
        expected = (model(clean + 0.5 * torch.sin(3 * clean)) - clean).pow(2).mean().item()
    assert losses[-1] == pytest.approx(expected, rel=1e-5), (losses[-1], expected)
    # every training record once, in order, the same over the continuation
    for out in (two, stopped):
        trained = [r["global_step"] for r in steps(out) if "train_loss" in r]
        assert trained == sorted(set(trained)) and trained[-1] == 3 * 512 // 32, trained
    train_losses = [r["train_loss"] for r in steps(two) if "train_loss" in r]
    continued_losses = [r["train_loss"] for r in steps(stopped) if "train_loss" in r]
    assert continued_losses == pytest.approx(train_losses, rel=1e-5)


YOUR_DISTILLATION = (
    YOUR_CLASSIFICATION
    + '''

def build_frozen(args, num_classes):
    # a teacher of fixed weights, larger than the student (a trained one would be loaded here)
    with torch.random.fork_rng():
        torch.manual_seed(7)
        teacher = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, num_classes))
    return {"teacher": teacher}


def train_step(run, inputs, targets) -> dict:
    """Distillation: the labels' loss and the divergence from the frozen teacher's softened scores."""
    model, optimizer = run.model, run.optimizer
    outputs = model(inputs)
    with torch.no_grad():
        taught = run.frozen["teacher"](inputs)
    soft = F.kl_div(F.log_softmax(outputs / 2, 1), F.softmax(taught / 2, 1), reduction="batchmean")
    loss = compute_loss(outputs, targets) + soft
    optimizer.zero_grad(set_to_none=True)
    run.backward(loss)
    optimizer.step()
    run.scheduler.step()
    return dict(loss=loss, outputs=outputs)
'''
)


def test_a_frozen_teacher_is_on_no_optimizer_and_in_no_saved_file_and_distills_alike_on_2_and_1(
    tmp_path,
):
    """A student distilled from a frozen teacher (build_frozen, used in the user's train_step): 2 x 16 == 1 x 32
    (1e-5); checkpoint.pt, model_ema.pt and model_best.pt hold the student's 4 tensors alone, its optimizer the
    student's parameters alone; the teacher's size said once; the student learns."""
    script = copy_with_your_functions("distributed.py", tmp_path / "copy", YOUR_DISTILLATION)
    flags = [*COMMON, "--ema", "0.9", "--keep-best", "val_acc"]
    one, two = tmp_path / "one", tmp_path / "two"
    results = run_parallel(
        [
            (launch(script, 1, *flags, "--output-dir", one), OFFLINE, tmp_path),
            (launch(script, 2, *flags, "--output-dir", two), OFFLINE, tmp_path),
        ]
    )
    difference = max_weight_difference(two, one)
    print(f"distillation: 2 x 16 against 1 x 32 {difference:.2g}")
    assert difference <= 1e-5
    student = ["1.weight", "1.bias", "3.weight", "3.bias"]
    checkpoint = torch.load(two / "checkpoint.pt", weights_only=True)
    assert list(checkpoint["model"]) == student
    for name in ("model_ema.pt", "model_best.pt"):
        assert list(torch.load(two / name, weights_only=True)) == student, name
    assert sum(len(g["params"]) for g in checkpoint["optimizer"]["param_groups"]) == len(student)
    # said once, by rank 0: 64 x 128 + 128 + 128 x 4 + 4 parameters
    assert results[1].stdout.count("frozen teacher: 8,836 parameters") == 1, results[1].stdout
    assert metrics(two)[-1]["val_acc"] >= 0.8, metrics(two)


YOUR_GAN = '''
from extras import together


class Points(torch.utils.data.Dataset):
    """Points of a plane around (2, -1); each sample also holds the generator's noise for it (drawn per sample:
    alike on any number of processes), and the discriminator's targets: real 1, generated 0."""

    def __init__(self, size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.points = torch.tensor([2.0, -1.0]) + 0.5 * torch.randn(size, 2, generator=generator)

    def __len__(self):
        return len(self.points)

    def __getitem__(self, index):
        return {"real": self.points[index], "noise": torch.randn(4)}, torch.tensor([1.0, 0.0])


class GAN(together.TrainedTogether):
    """The generator and the discriminator, trained together: each its own DDP and optimizer."""

    def forward(self, real, noise):
        """What validation scores: the discriminator's logits of real points and of generated ones."""
        generator, discriminator = self["generator"], self["discriminator"]
        return self.scores(discriminator, real, generator(noise))

    @staticmethod
    def scores(discriminator, real, fake):
        return discriminator(torch.cat([real, fake])).view(2, -1).T


def build_datasets(args):
    return Points(512, seed=1), Points(203, seed=2), 2


def build_model(args, num_classes):
    return GAN(
        {
            "generator": nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2)),
            "discriminator": nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1)),
        }
    )


def compute_loss(outputs, targets):
    """The discriminator's loss: real points scored 1, generated ones 0."""
    return F.binary_cross_entropy_with_logits(outputs, targets)


def train_step(run, inputs, targets) -> dict:
    """A discriminator step, then a generator step."""
    # a preemption at the STOP_AT-th step of rank 1, as a scheduler's SIGTERM
    global calls
    calls += 1
    if os.environ.get("RANK", "0") == "1" and calls == int(os.environ.get("STOP_AT", 0)):
        os.kill(os.getpid(), signal.SIGTERM)
    generator, discriminator = run.model["generator"], run.model["discriminator"]
    fake = generator(inputs["noise"])
    real = inputs["real"].requires_grad_()
    outputs = GAN.scores(discriminator, real, fake.detach())
    loss = compute_loss(outputs, targets)
    # R1's gradient penalty: each real point's gradient, taken with create_graph and backwarded through
    (slopes,) = torch.autograd.grad(outputs[:, 0].sum(), real, create_graph=True)
    penalty = slopes.pow(2).sum(1).mean()
    run.optimizer["discriminator"].zero_grad(set_to_none=True)
    run.backward(loss + penalty)
    run.optimizer["discriminator"].step()
    # the generator: its points scored as real
    fooled = discriminator(fake)
    generator_loss = F.binary_cross_entropy_with_logits(fooled, torch.ones_like(fooled))
    run.optimizer["generator"].zero_grad(set_to_none=True)
    run.backward(generator_loss)
    run.optimizer["generator"].step()
    run.scheduler.step()  # both schedules
    return dict(loss=loss, outputs=outputs, generator_loss=generator_loss)


calls = 0
'''


def test_a_gan_of_two_ddps_and_two_optimizers_trains_alike_on_2_and_1_continues_exactly_and_is_profiled_by_step(
    tmp_path,
):
    """A GAN in the user's train_step (build_model's together.TrainedTogether: each model its own DDP and optimizer, a
    discriminator step with a gradient penalty's double backward and a generator step per step): 2 x 16 == 1 x 32 (1e-5), both losses recorded over all
    ranks; SIGTERM to rank 1 mid-epoch and the same command again == the straight run (1e-6, both models, both
    optimizers and schedules), each step's record once; --profile 3:5 holds steps 3 to 5 each once (one data phase,
    two optimizer steps each); the generator's points move toward the data. dataparallel.py, which trains one model,
    refuses them in one line."""
    script = copy_with_your_functions(
        "distributed.py", tmp_path / "copy", "import os\nimport signal\n" + YOUR_GAN
    )
    flags = [*COMMON, "--print-freq", "4", "--optimizer", "adamw", "--lr", "0.01"]
    elsewhere = copy_with_your_functions(
        "dataparallel.py", tmp_path / "dp-copy", "import os\nimport signal\n" + YOUR_GAN
    )
    one, two, stopped = tmp_path / "one", tmp_path / "two", tmp_path / "stopped"
    results = run_parallel(
        [
            (launch(script, 1, *flags, "--output-dir", one), OFFLINE, tmp_path),
            (launch(script, 2, *flags, "--profile", "3:5", "--output-dir", two), OFFLINE, tmp_path),
            (
                launch(script, 2, *flags, "--output-dir", stopped),
                {**OFFLINE, "STOP_AT": "21"},
                tmp_path,
            ),
            (launch(elsewhere, 1, *flags, "--output-dir", tmp_path / "dp"), OFFLINE, tmp_path),
        ],
        check=False,
    )
    # a script that trains one model says so, in one line
    assert results[-1].returncode == 1 and results[-1].stderr.strip().splitlines() == [
        "error: build_model's GAN is models trained together (extras/together.py): distributed.py,"
        " distributed_mp.py and distributed_amp.py train each in its own DDP; this script trains one model"
    ], results[-1].stderr
    state = torch.load(stopped / "checkpoint.pt", weights_only=True)
    assert state["epoch"] == 1 and 0 < state["step"] < 16, (state["epoch"], state["step"])
    run_parallel([(launch(script, 2, *flags, "--output-dir", stopped), OFFLINE, tmp_path)])
    differences = max_weight_difference(two, one), max_weight_difference(stopped, two)
    print(f"GAN: 2 x 16 against 1 x 32 {differences[0]:.2g}, continued {differences[1]:.2g}")
    assert differences[0] <= 1e-5 and differences[1] <= 1e-6, differences
    straight, continued = (
        torch.load(d / "checkpoint.pt", weights_only=True) for d in (two, stopped)
    )
    assert sorted(straight["optimizer"]) == ["discriminator", "generator"]
    for name in ("optimizer", "scheduler"):
        assert_same_state(continued[name], straight[name])
    # every training record once, in order; both losses over all ranks' samples: 1 process's, and the same over
    # the continuation
    records = {out: [r for r in steps(out) if "train_loss" in r] for out in (one, two, stopped)}
    for out, trained in records.items():
        assert [r["global_step"] for r in trained] == list(range(4, 49, 4)), out
    for key in ("train_loss", "train_generator_loss"):
        for out in (one, stopped):
            assert [r[key] for r in records[out]] == pytest.approx(
                [r[key] for r in records[two]], rel=1e-5
            ), (key, out)
    # --profile 3:5 on each rank: 3 steps, each a data phase and two optimizer steps
    for rank in (0, 1):
        trace = json.loads((two / "profile" / f"rank{rank}.json").read_text())["traceEvents"]
        names = [
            e["name"] for e in sorted(trace, key=lambda e: e.get("ts", 0)) if e.get("ph") == "X"
        ]
        assert names.count("data") == 3 and names.count("optimizer") == 6, names
    # the generator's points, at the end, near the data's centre (its untrained ones are far from it)
    namespace = {"torch": torch, "nn": torch.nn, "F": torch.nn.functional, "utils": utils}
    exec("import os\nimport signal\n" + YOUR_GAN, namespace)
    gan = namespace["build_model"](None, 2)
    untrained = gan["generator"](torch.randn(1000, 4)).mean(0)
    gan.load_state_dict(straight["model"])
    trained = gan["generator"](torch.randn(1000, 4)).mean(0)
    centre = torch.tensor([2.0, -1.0])
    print(f"GAN: the generator's mean {untrained.tolist()} untrained, {trained.tolist()} trained")
    assert (trained - centre).norm() < (untrained - centre).norm() / 2


def assert_same_state(a, b) -> None:
    """Two state_dicts (nested dicts, lists, tensors, numbers) equal, tensors within 1e-6."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_state(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_state(x, y)
    elif isinstance(a, torch.Tensor):
        assert (a.double() - b.double()).abs().max().item() <= 1e-6
    else:
        assert a == b


ESSENTIALS = {
    "distributed.py": "DDP",
    "distributed_mp.py": "DDP",
    "distributed_amp.py": "DDP",
    "distributed_grad_accum.py": "DDP",
    "distributed_fsdp.py": "fully_shard",
    "distributed_diloco.py": None,  # no wrapper: its outer step averages the ranks' weights
}


def calls_in(tree: ast.AST) -> set[str]:
    """The dotted names called in tree: "dist.init_process_group", "DDP", "train_sampler.set_epoch"."""
    return {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}


@pytest.mark.parametrize("script", ESSENTIALS)
def test_each_ddp_script_shows_the_essentials_as_plain_pytorch_calls(script):
    """Read as a user reads it, each DDP script calls PyTorch's own: dist.init_process_group, torch.cuda.set_device,
    a DistributedSampler with set_epoch, the DDP wrap (FSDP's fully_shard), its writes under `if rank == 0` (or
    dist.get_rank()), and the validation's dist.all_reduce in evaluate itself."""
    tree = ast.parse((ROOT / script).read_text())
    functions = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    called = calls_in(tree)
    assert {"dist.init_process_group", "torch.cuda.set_device", "DistributedSampler"} <= called
    assert any(name.endswith("sampler.set_epoch") for name in called), sorted(called)
    if ESSENTIALS[script]:
        assert ESSENTIALS[script] in called
    assert "dist.all_reduce" in calls_in(functions["evaluate"])
    # the checkpoint written by rank 0 alone (FSDP: its model.pt; each rank writes its own shards)
    rank_0 = [
        node
        for node in ast.walk(functions["save_checkpoint"])
        if isinstance(node, ast.If)
        and ast.unparse(node.test) in ("rank == 0", "dist.get_rank() == 0")
    ]
    written = {name.rsplit(".", 1)[-1] for node in rank_0 for name in calls_in(node)}
    assert written & {"save", "save_checkpoint"}, (script, written)
