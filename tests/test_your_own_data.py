"""A user copies one script and utils.py, replaces build_datasets() and build_model() with
their own (inputs that are not images, a plain Dataset, an MLP), and everything still works."""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest
import torch

import utils
from processes import PYTHON, ROOT, finish, max_weight_difference, metrics, run, start, wait_for, weights

YOUR_DATA_AND_MODEL = '''
class Blobs(torch.utils.data.Dataset):
    """Float inputs of shape (1, 8, 8), already normalised, around one centre per class; no __getitems__."""

    def __init__(self, size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        centres = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
        self.labels = torch.randint(0, 4, (size,), generator=generator)
        self.inputs = centres[self.labels] + 1.5 * torch.randn(size, 1, 8, 8, generator=generator)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.inputs[index], int(self.labels[index])


def build_datasets(args):
    return Blobs(640, seed=1), Blobs(203, seed=2), 4  # 203: an odd count over 2 ranks


def build_model(args, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, num_classes))
'''

COMMON = ["--batch-size", "32", "--epochs", "3", "--lr", "0.05", "--workers", "0", "--timeout", "60"]


def copy_with_your_functions(script: str, directory: Path, yours: str = YOUR_DATA_AND_MODEL) -> Path:
    """script and utils.py copied into directory, build_datasets and build_model replaced."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "utils.py", directory)
    source = (ROOT / script).read_text()
    lines = source.splitlines(keepends=True)
    spans = sorted((node.lineno, node.end_lineno) for node in ast.parse(source).body
                   if isinstance(node, ast.FunctionDef) and node.name in ("build_datasets", "build_model"))
    assert len(spans) == 2 and spans[0][1] < spans[1][0], f"{script} must define both functions"
    # everything from the first function's def to the second's end becomes the user's code
    new = lines[:spans[0][0] - 1] + [yours.lstrip("\n")] + lines[spans[1][1]:]
    (directory / script).write_text("".join(new))
    return directory / script


def launch(script_path: Path, processes: int, *args) -> list:
    if script_path.name == "distributed_mp.py":
        return [PYTHON, script_path, "--nproc", str(processes), *args]
    if processes == 1:
        return [PYTHON, script_path, *args]
    return [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
            script_path, *args]


@pytest.fixture(scope="module")
def single_process(tmp_path_factory) -> Path:
    """The user's job trained by their copy of distributed.py in one process: the reference."""
    base = tmp_path_factory.mktemp("yours")
    script = copy_with_your_functions("distributed.py", base / "copy")
    run([PYTHON, script, *COMMON, "--output-dir", base / "out"])
    return base / "out"


# (script, processes, extra flags, equal to one process with the whole batch?)
CASES = {
    "distributed.py": ("distributed.py", 2, [], True),
    "distributed_mp.py": ("distributed_mp.py", 2, [], True),
    "distributed_grad_accum.py": ("distributed_grad_accum.py", 2, ["--accum-steps", "2"], True),
    "dataparallel.py": ("dataparallel.py", 1, [], True),
    "distributed_amp.py": ("distributed_amp.py", 2, ["--amp-dtype", "bfloat16"], False),  # other arithmetic
}


@pytest.mark.parametrize("case", CASES)
def test_your_data_and_model_train_in_every_script(case, tmp_path, single_process):
    script, processes, flags, exact = CASES[case]
    copy = copy_with_your_functions(script, tmp_path / "copy")
    out = tmp_path / "out"
    run(launch(copy, processes, *COMMON, *flags, "--output-dir", out), cwd=tmp_path)
    final = metrics(out)[-1]
    assert final["val_acc"] > 0.9, final  # chance is 0.25
    assert [m["val_images"] for m in metrics(out)] == [203] * 3  # each validation input once
    assert final["tflops"] > 0  # FLOPs counted on a real batch of the user's inputs
    assert list(weights(out)) == ["1.weight", "1.bias", "3.weight", "3.bias"]  # plain keys
    if exact:
        assert max_weight_difference(out, single_process) <= 1e-5


def test_your_run_with_dropout_continues_exactly_mid_epoch(tmp_path):
    """Dropout draws from the global random stream: the checkpoint keeps it, and the loader draws its
    worker seeds from a generator of its own, so a run killed mid-epoch and continued is exact."""
    yours = YOUR_DATA_AND_MODEL.replace("Blobs(640", "Blobs(20000").replace("nn.Tanh(),", "nn.Tanh(), nn.Dropout(0.5),")
    copy = copy_with_your_functions("distributed.py", tmp_path / "copy", yours)
    args = [*COMMON, "--save-every", "50"]
    run([PYTHON, copy, *args, "--output-dir", tmp_path / "straight"], cwd=tmp_path)
    out = tmp_path / "killed"
    proc, marker = start([PYTHON, copy, *args, "--output-dir", out], cwd=tmp_path)
    wait_for(lambda: (out / "checkpoint.pt").exists(), 120, "the first checkpoint")
    assert proc.poll() is None, "finished before the kill"
    proc.kill()
    finish(proc, marker, timeout=60)
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state["step"] > 0 and "rng" in state  # killed in the middle of an epoch
    run([PYTHON, copy, *args, "--output-dir", out], cwd=tmp_path)
    assert max_weight_difference(out, tmp_path / "straight") <= 1e-6


def test_the_built_in_fast_path_leaves_your_inputs_alone():
    """Inputs of a Dataset without a batch_transform reach the model exactly as it made them."""
    inputs = torch.randn(5, 1, 8, 8)
    batch = (inputs.clone(), torch.arange(5))
    moved, targets = utils.batch_to_device(batch, torch.device("cpu"), torch.utils.data.TensorDataset(inputs),
                                           channels_last=True, key=(0, 1))
    assert torch.equal(moved, inputs) and torch.equal(targets, torch.arange(5))


def test_flags_are_also_accepted_in_snake_case():
    """Other tutorials write --batch_size=128 and --output_dir; values keep their underscores."""
    args = utils.build_parser("x").parse_args(["--batch_size=128", "--output_dir", "my_out", "--data-dir=a_b",
                                               "--no_augment", "--fake_size", "64"])
    assert (args.batch_size, args.output_dir, args.data_dir, args.no_augment, args.fake_size) == (
        128, "my_out", "a_b", True, 64)


def code_lines(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip() and not line.strip().startswith("#"))


def test_utils_stays_small_and_each_script_holds_its_recipe():
    # 399 when the recipe moved into the scripts; preemption, storage and model checks and --compile-mode
    # added about 80
    assert code_lines(ROOT / "utils.py") <= 485
    for script in CASES:
        source = (ROOT / script).read_text()
        assert code_lines(ROOT / script) <= 250, script
        calls = ["DataLoader(", "def build_datasets(args)", "def build_model(args, num_classes"]
        if script != "dataparallel.py":
            calls += ["init_process_group(", "DistributedSampler(", "range(rank, len(val_set), world_size)",
                      "DDP(", "set_epoch(", "dist.broadcast(", "destroy_process_group()", "barrier()"]
        assert all(call in source for call in calls), (script, [c for c in calls if c not in source])
