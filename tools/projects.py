"""The user projects the tests and tools train, and a user's copy of a script: the core and the extras copied
beside it, its plug points replaced by the user's own code (copy_with_your_functions), launched as they launch it."""

from __future__ import annotations

import ast
import shlex
import shutil
import subprocess
from pathlib import Path

import torch

from processes import PYTHON, ROOT

YOUR_CLASSIFICATION = '''
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


def compute_loss(outputs, targets):
    return F.cross_entropy(outputs, targets)
'''

YOUR_REGRESSION = '''
class Line(torch.utils.data.Dataset):
    """(8 float features, 1 float target): a noisy linear function, nothing to classify."""

    def __init__(self, size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 8, generator=generator)
        self.y = self.x @ torch.linspace(-1, 1, 8).view(8, 1) + 0.05 * torch.randn(size, 1, generator=generator)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


def build_datasets(args):
    return Line(640, seed=1), Line(203, seed=2), 1  # 203: an odd count over 2 ranks


def build_model(args, num_classes):
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def compute_loss(outputs, targets):
    return F.mse_loss(outputs, targets)
'''

YOUR_DICT_INPUTS = '''
class Tokens(torch.utils.data.Dataset):
    """({"input_ids": 12 token ids, "mask": which are real}, label), as text libraries return them:
    a label's own 4 of 16 tokens are more frequent in its sequences; padding is token 0."""

    def __init__(self, size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 4, (size,), generator=generator)
        own = 1 + 4 * self.labels.view(size, 1) + torch.randint(0, 4, (size, 12), generator=generator)
        other = torch.randint(1, 17, (size, 12), generator=generator)
        self.ids = torch.where(torch.rand(size, 12, generator=generator) < 0.7, own, other)
        self.mask = torch.arange(12) < torch.randint(4, 13, (size, 1), generator=generator)
        self.ids[~self.mask] = 0

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "mask": self.mask[index]}, int(self.labels[index])


class MeanOfEmbeddings(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.embed, self.head = nn.Embedding(17, 16), nn.Linear(16, num_classes)

    def forward(self, input_ids, mask):  # the Dataset's dict of inputs, as keyword arguments
        mask = mask.unsqueeze(-1).float()
        return self.head((self.embed(input_ids) * mask).sum(1) / mask.sum(1))


def build_datasets(args):
    return Tokens(640, seed=1), Tokens(203, seed=2), 4


def build_model(args, num_classes):
    return MeanOfEmbeddings(num_classes)


def compute_loss(outputs, targets):
    return F.cross_entropy(outputs, targets)
'''


def users_code(yours: str) -> dict:
    """What the user's code defines, run with the names a script gives it."""
    namespace = {"torch": torch, "nn": torch.nn, "F": torch.nn.functional}
    exec(yours, namespace)
    return namespace


YOUR_CLASSIFICATION_LOSS = users_code(YOUR_CLASSIFICATION)[
    "compute_loss"
]  # F.cross_entropy(outputs, targets)
PLUG_POINTS = ("build_datasets", "build_model", "compute_loss", "collate")
# what a project adds when it samples, measures or steps in its own way (a version before them had none)
OPTIONAL_PLUG_POINTS = (
    "collate",
    "build_sampler",
    "build_metrics",
    "build_frozen",
    "train_step",
    "eval_step",
)
COMMON = [
    "--batch-size",
    "32",
    "--epochs",
    "3",
    "--lr",
    "0.05",
    "--workers",
    "0",
    "--timeout",
    "60",
]


# a project's own utils.py, which a script must leave alone once ours is its ddp_utils/
THEIR_UTILS = 'raise ImportError("the project\'s own utils.py was imported")\n'


def rename_utils(directory: Path) -> None:
    """The README's own sed, run on directory's script and extras: their imports of utils.py made ddp_utils.py's."""
    readme = (ROOT / "README.md").read_text().splitlines()
    words = shlex.split(next(line for line in readme if line.strip().startswith("sed -i -E ")))
    files = [
        path for path in directory.glob("*.py") if path.name not in ("utils.py", "ddp_utils.py")
    ]
    subprocess.run(
        [*words[:4], *files, *(directory / "extras").glob("*.py")], check=True, timeout=30
    )


def copy_core(root: Path, directory: Path, core: str = "utils") -> None:
    """What a user copies beside a script: the core (utils.py, or as core.py) and the extras/ folder; of another
    version of this repository, its utils/ folder or its utils.py, stalls.py and streams.py."""
    ignore = shutil.ignore_patterns("__pycache__")
    if (root / "utils").is_dir():  # an older version's folder
        shutil.copytree(root / "utils", directory / core, ignore=ignore, dirs_exist_ok=True)
    if (root / "extras").is_dir():
        shutil.copytree(root / "extras", directory / "extras", ignore=ignore, dirs_exist_ok=True)
    if (root / "utils.py").exists():
        shutil.copy(root / "utils.py", directory / f"{core}.py")
    for name in ("stalls.py", "streams.py"):
        if (root / name).exists():
            shutil.copy(root / name, directory)


def copy_with_your_functions(
    script: str, directory: Path, yours: str | None, root: Path = ROOT, folder: str = "utils"
) -> Path:
    """script with the core and extras a user copies (of root: this repository, or another version of it, whose
    files were utils.py, stalls.py and streams.py, or a utils/ folder) copied into directory, its plug-point functions
    replaced by yours (None: its own; the script's own collate(), build_sampler() and build_metrics() where yours
    defines none). folder other than utils: the core copied under that name (ddp_utils.py) beside a project's own
    utils.py, which raises on import, the script's and the extras' import lines changed (the README's sed)."""
    directory.mkdir(parents=True, exist_ok=True)
    copy_core(root, directory, folder)
    if folder != "utils":
        (directory / "utils.py").write_text(THEIR_UTILS)
    source = (root / script).read_text()
    lines = source.splitlines(keepends=True)
    spans = {
        node.name: (node.lineno, node.end_lineno)
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef) and node.name in PLUG_POINTS + OPTIONAL_PLUG_POINTS
    }
    assert set(PLUG_POINTS) <= set(spans), f"{script} must define {PLUG_POINTS}"
    if yours is None:  # the script's own
        first, last = min(spans.values()), max(spans.values())
        yours = "".join(lines[first[0] - 1 : last[1]])
    for name in OPTIONAL_PLUG_POINTS:
        if f"def {name}(" not in yours and name in spans:
            yours += "\n\n" + "".join(lines[spans[name][0] - 1 : spans[name][1]])
    spans = sorted(spans.values())
    # everything from the first function's def to the last one's end becomes the user's code
    new = lines[: spans[0][0] - 1] + [yours.lstrip("\n")] + lines[spans[-1][1] :]
    (directory / script).write_text("".join(new))
    if folder != "utils":
        assert folder == "ddp_utils", "the README's sed names ddp_utils"
        rename_utils(directory)
    return directory / script


def launch(script_path: Path, processes: int, *args) -> list:
    if script_path.name == "distributed_mp.py":
        return [PYTHON, script_path, "--nproc", str(processes), *args]
    if processes == 1:
        return [PYTHON, script_path, *args]
    return [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
        script_path,
        *args,
    ]


# a user's language model: GPT-2 from a small config on arithmetic progressions, a (sum, count) token loss
YOUR_LANGUAGE_MODEL = '''
from transformers import GPT2Config, GPT2LMHeadModel

CONFIG = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=1)


class Progressions(torch.utils.data.Dataset):
    """Sequences of 4 to 24 tokens a, a + d, a + 2d, ... (mod 62, from token 2): learnable after two tokens."""

    def __init__(self, size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        start = torch.randint(0, 62, (size,), generator=generator)
        step = torch.randint(1, 4, (size,), generator=generator)
        lengths = torch.randint(4, 25, (size,), generator=generator)
        self.ids = [2 + (a + d * torch.arange(n)) % 62 for a, d, n in zip(start, step, lengths)]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return self.ids[index], self.ids[index]


def build_datasets(args):
    return Progressions(640, seed=1), Progressions(203, seed=2), 64


def build_model(args, num_classes):
    return GPT2LMHeadModel(CONFIG)  # its head is tied to its token embedding


def compute_loss(outputs, targets):
    """Next-token cross-entropy summed over the real tokens, and their count."""
    logits, labels = outputs.logits[:, :-1], targets[:, 1:]
    return F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="sum"), (labels != -100).sum()


def collate(samples):
    ids = nn.utils.rnn.pad_sequence([ids for ids, _ in samples], batch_first=True, padding_value=0)
    labels = nn.utils.rnn.pad_sequence([ids for ids, _ in samples], batch_first=True, padding_value=-100)
    return {"input_ids": ids, "attention_mask": (labels != -100).long()}, labels
'''
