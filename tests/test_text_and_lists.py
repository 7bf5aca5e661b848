"""Text and other batches of any structure, as a user brings them to a copy of a script: sentences of different
lengths padded by their collate(), a token-level loss returned as (sum, count), a Hugging Face model returned by
build_model as it is, detection-style lists of per-image dicts."""

from __future__ import annotations

import signal
import time

import pytest
import torch

from processes import (
    PYTHON,
    assert_same_records,
    finish,
    max_weight_difference,
    metrics,
    run,
    run_parallel,
    start,
    steps,
    wait_for,
    weights,
)
from projects import COMMON, copy_with_your_functions, launch, users_code

YOUR_TAGGER = '''
class Sentences(torch.utils.data.Dataset):
    """Token ids (1 to 32), 3 to 40 a sentence, and a tag per token that follows from the token and the one
    before it: what a tagger trains on."""

    def __init__(self, size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(3, 41, (size,), generator=generator).tolist()
        self.ids = [torch.randint(1, 33, (n,), generator=generator) for n in lengths]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        ids = self.ids[index]
        previous = torch.cat([torch.zeros(1, dtype=ids.dtype), ids[:-1]])
        return ids, (ids + (previous > 16).long()) % 4


class Tagger(nn.Module):
    def __init__(self, tags):
        super().__init__()
        self.embed = nn.Embedding(33, 16, padding_idx=0)
        self.mix = nn.Conv1d(16, 32, 2)  # a token and the one before it
        self.head = nn.Conv1d(32, tags, 1)

    def forward(self, ids):
        x = nn.functional.pad(self.embed(ids).transpose(1, 2), (1, 0))  # (N, 16, L + 1): look back only
        return self.head(torch.tanh(self.mix(x)))  # (N, tags, L): scores at dim 1


def build_datasets(args):
    return Sentences(SIZE, seed=1), Sentences(203, seed=2), 4  # 203: an odd count over 2 ranks


def build_model(args, num_classes):
    return Tagger(num_classes)


def compute_loss(outputs, targets):
    """Summed over the real tokens, and their count: the exact mean over all ranks' tokens."""
    return F.cross_entropy(outputs, targets, ignore_index=-100, reduction="sum"), (targets != -100).sum()


def collate(samples):
    """Sentences padded to the longest in the batch: ids with 0, tags with -100 (ignored by the loss)."""
    ids = nn.utils.rnn.pad_sequence([ids for ids, _ in samples], batch_first=True, padding_value=0)
    tags = nn.utils.rnn.pad_sequence([tags for _, tags in samples], batch_first=True, padding_value=-100)
    return ids, tags
'''
TOKEN_SUM = (
    'F.cross_entropy(outputs, targets, ignore_index=-100, reduction="sum"), (targets != -100).sum()'
)
TOKEN_MEAN_PER_RANK = (
    "F.cross_entropy(outputs, targets, ignore_index=-100)"  # what the textbook loop does
)
TEXT = [*COMMON, "--lr", "0.5"]
# of 20 steps an epoch: training records at steps 6, 12, 18 and 20; validation at 8, 16 and 20
RECORDS = ["--print-freq", "6", "--eval-every", "8"]


def tagger(size: int = 640, loss: str = TOKEN_SUM) -> str:
    return "SIZE = %d\n" % size + YOUR_TAGGER.replace(TOKEN_SUM, loss)


# name: (script, processes, flags, the user's code)
TAGGER_RUNS = {
    "one process": ("dataparallel.py", 1, [], tagger()),
    "two processes": ("distributed.py", 2, [], tagger()),
    "two processes x 2 micro-batches": (
        "distributed_grad_accum.py",
        2,
        ["--accum-steps", "2"],
        tagger(),
    ),
    "two processes, mean per rank": ("distributed.py", 2, [], tagger(loss=TOKEN_MEAN_PER_RANK)),
    "two processes, bfloat16": ("distributed_amp.py", 2, ["--amp-dtype", "bfloat16"], tagger()),
    "two processes, FSDP": ("distributed_fsdp.py", 2, [], tagger()),
}


@pytest.fixture(scope="module")
def tagger_runs(tmp_path_factory) -> dict:
    """The user's tagger trained by each run of TAGGER_RUNS: its output directory by name."""
    base, outputs, commands = tmp_path_factory.mktemp("tagger"), {}, []
    for i, (name, (script, processes, flags, yours)) in enumerate(TAGGER_RUNS.items()):
        copy = copy_with_your_functions(script, base / f"copy{i}", yours)
        outputs[name] = base / f"out{i}"
        commands.append(
            (launch(copy, processes, *TEXT, *flags, *RECORDS, "--output-dir", outputs[name]), {})
        )
    run_parallel(
        commands, timeout=400, cwd=base
    )  # all at once: independent, and sharing the cores better
    return outputs


def test_a_token_loss_is_exact_over_ranks_and_micro_batches(tagger_runs):
    """Sentences of 3 to 40 tokens: ranks and micro-batches hold different numbers of tokens. With (sum, count)
    2 processes and 2 x 2 micro-batches train the weights of 1 process; a mean per rank, averaged by DDP, would
    weigh the tokens of short sentences more."""
    one = tagger_runs["one process"]
    two = max_weight_difference(tagger_runs["two processes"], one)
    accumulated = max_weight_difference(tagger_runs["two processes x 2 micro-batches"], one)
    sharded = max_weight_difference(tagger_runs["two processes, FSDP"], one)  # its model.pt
    per_rank = max_weight_difference(tagger_runs["two processes, mean per rank"], one)
    print(
        f"max weight difference to 1 process: 2 processes {two:.1e}, 2 x 2 micro-batches {accumulated:.1e}, "
        f"2 processes with FSDP {sharded:.1e}, 2 processes with a mean per rank {per_rank:.1e}"
    )
    assert two <= 1e-5 and accumulated <= 1e-5 and sharded <= 1e-5
    assert per_rank > 1e-4  # the error that (sum, count) removes, seen by this same test
    for name in ("two processes", "two processes x 2 micro-batches", "two processes, FSDP"):
        for a, b in zip(metrics(tagger_runs[name]), metrics(one)):
            assert a["train_loss"] == pytest.approx(
                b["train_loss"], abs=1e-5
            )  # per token over all ranks
            assert a["val_loss"] == pytest.approx(b["val_loss"], abs=1e-5)
            assert a["val_images"] == 203  # sentences, not tokens, each once
    for name in ("one process", "two processes, bfloat16"):
        assert metrics(tagger_runs[name])[-1]["val_acc"] > 0.9, metrics(
            tagger_runs[name]
        )  # per token; chance 0.25


def test_records_of_a_token_loss_are_exact_over_ranks_and_micro_batches(tagger_runs):
    """steps.jsonl with (sum, count): every record's loss is the mean over all ranks' and micro-batches' tokens
    since the previous record, one record per optimizer step, and tokens per second beside samples per second."""
    one = steps(tagger_runs["one process"])
    assert [r["global_step"] for r in one][:7] == [
        6,
        8,
        12,
        16,
        18,
        20,
        20,
    ]  # training, then validation, at 20
    for name in ("two processes", "two processes x 2 micro-batches", "two processes, FSDP"):
        assert_same_records(steps(tagger_runs[name]), one, tolerance=1e-5)
    train = [r for r in one if "train_loss" in r]
    assert all(r["items_per_s"] > r["images_per_s"] > 0 for r in train)  # 3 to 40 tokens a sentence
    assert [r["val_images"] for r in one if "val_loss" in r] == [203] * 9


def test_the_logged_validation_loss_is_the_mean_over_every_token(tagger_runs):
    """The checkpoint's tagger scored in this process on the whole validation set at once."""
    yours = users_code(tagger())
    model = yours["Tagger"](4)
    model.load_state_dict(weights(tagger_runs["two processes"]))
    samples = [yours["Sentences"](203, seed=2)[i] for i in range(203)]
    ids, tags = yours["collate"](samples)
    with torch.no_grad():
        total, count = yours["compute_loss"](model(ids), tags)
    logged = metrics(tagger_runs["two processes"])[-1]["val_loss"]
    print(
        f"validation loss: logged {logged:.6f}, mean over all {int(count)} tokens {total.item() / count:.6f}"
    )
    assert logged == pytest.approx(total.item() / count.item(), rel=1e-5)


def test_sigterm_with_your_collate_continues_exactly(tmp_path):
    """Padded sentences, AdamW and gradient clipping, 2 processes by mp.spawn: the loader that continues the
    epoch pads with the user's collate too, and the continued run ends where a straight one does."""
    copy = copy_with_your_functions("distributed_mp.py", tmp_path / "copy", tagger(size=20000))
    args = [
        PYTHON,
        copy,
        "--nproc",
        "2",
        *COMMON,
        "--epochs",
        "1",
        "--optimizer",
        "adamw",
        "--lr",
        "0.01",
        "--clip-grad",
        "0.5",
        "--save-every",
        "20",
        "--print-freq",
        "1000",
    ]
    run([*args, "--output-dir", tmp_path / "straight"], cwd=tmp_path)
    out = tmp_path / "preempted"
    proc, marker = start([*args, "--output-dir", out], cwd=tmp_path)
    wait_for(lambda: (out / "checkpoint.pt").exists(), 120, "the first checkpoint")
    time.sleep(0.2)
    assert proc.poll() is None, "finished before the signal: make the epoch longer"
    proc.send_signal(signal.SIGTERM)
    result = finish(proc, marker, timeout=60)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state["epoch"] == 0 and 0 < state["step"] < 625 and state["optimizer_name"] == "adamw"
    second = run([*args, "--output-dir", out], cwd=tmp_path)
    assert f"0 of 1 epochs done and {state['step']} steps of the next" in second.stdout
    difference = max_weight_difference(out, tmp_path / "straight")
    print(
        f"stopped after step {state['step']}/625; continued vs straight: max weight difference {difference:.1e}"
    )
    assert difference <= 1e-6
    assert metrics(out)[-1]["val_acc"] > 0.9


YOUR_HUGGING_FACE_MODEL = '''
from transformers import BertConfig, BertForSequenceClassification

CONFIG = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                    max_position_embeddings=32, num_labels=2)


class Reviews(torch.utils.data.Dataset):
    """[CLS] (id 1) and 3 to 24 word ids: a label's own half of the words (2-32 or 33-63) is more frequent."""

    def __init__(self, size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 2, (size,), generator=generator).tolist()
        self.ids = []
        for label in self.labels:
            n = int(torch.randint(3, 25, (), generator=generator))
            own = 2 + 31 * label + torch.randint(0, 31, (n,), generator=generator)
            other = torch.randint(2, 64, (n,), generator=generator)
            words = torch.where(torch.rand(n, generator=generator) < 0.6, own, other)
            self.ids.append(torch.cat([torch.ones(1, dtype=torch.long), words]))

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.ids[index], self.labels[index]


def build_datasets(args):
    return Reviews(640, seed=1), Reviews(203, seed=2), 2


def build_model(args, num_classes):
    return BertForSequenceClassification(CONFIG)  # as it is: it takes input_ids= and attention_mask=


def compute_loss(outputs, targets):
    return F.cross_entropy(outputs.logits, targets)  # outputs: a SequenceClassifierOutput


def collate(samples):
    """Padded to the longest in the batch (id 0), with the mask that tells BERT which tokens are real."""
    ids = nn.utils.rnn.pad_sequence([ids for ids, _ in samples], batch_first=True, padding_value=0)
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}, torch.tensor([label for _, label in samples])
'''


def test_a_hugging_face_model_trains_as_it_is_with_adamw(tmp_path):
    """A real transformers BERT built from a small config (nothing downloaded), returned by build_model
    unchanged: dict batches go in as keyword arguments, its ModelOutput reaches compute_loss, accuracy is
    read from its logits. Its checkpoint loads into a fresh model of the config and scores what was logged."""
    copy = copy_with_your_functions("distributed.py", tmp_path / "copy", YOUR_HUGGING_FACE_MODEL)
    out = tmp_path / "out"
    no_lr = [
        "--batch-size",
        "32",
        "--epochs",
        "3",
        "--workers",
        "0",
        "--timeout",
        "60",
    ]  # AdamW's default
    result = run(launch(copy, 2, *no_lr, "--optimizer", "adamw", "--output-dir", out), cwd=tmp_path)
    assert (
        "adamw peak lr 0.001, weight decay 0.01" in result.stdout
    )  # AdamW's own defaults, printed
    epochs = metrics(out)
    print(
        "BERT from a config, AdamW, 2 processes: val_acc by epoch",
        [round(m["val_acc"], 4) for m in epochs],
    )
    assert epochs[-1]["val_acc"] >= 0.9 and [m["val_images"] for m in epochs] == [203] * 3
    yours = users_code(YOUR_HUGGING_FACE_MODEL)
    model = yours["BertForSequenceClassification"](yours["CONFIG"]).eval()
    model.load_state_dict(weights(out))  # strict: every key, plain
    inputs, labels = yours["collate"]([yours["Reviews"](203, seed=2)[i] for i in range(203)])
    with torch.no_grad():
        accuracy = (model(**inputs).logits.argmax(1) == labels).double().mean().item()
    assert accuracy == pytest.approx(epochs[-1]["val_acc"], abs=1e-9)


YOUR_DETECTION_LISTS = '''
class Boxes(torch.utils.data.Dataset):
    """(image, {"boxes": (n, 4), "labels": (n,)}) with 0 to 5 boxes an image, as torchvision's detection models
    take targets; the image is brighter the more boxes it holds."""

    def __init__(self, size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.counts = torch.randint(0, 6, (size,), generator=generator).tolist()
        self.images = torch.stack([torch.full((3, 8, 8), n / 50) for n in self.counts]) + 0.02 * torch.randn(
            size, 3, 8, 8, generator=generator)

    def __len__(self):
        return len(self.counts)

    def __getitem__(self, index):
        n = self.counts[index]
        return self.images[index], {"boxes": torch.rand(n, 4), "labels": torch.ones(n, dtype=torch.long)}


def build_datasets(args):
    return Boxes(640, seed=1), Boxes(203, seed=2), 1


def build_model(args, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(192, 16), nn.Tanh(), nn.Linear(16, 1))  # how many boxes


def compute_loss(outputs, targets):
    counts = torch.tensor([float(len(t["boxes"])) for t in targets], device=outputs.device)
    return F.mse_loss(outputs.squeeze(1), counts)


def collate(samples):
    """Images stacked; targets a list of per-image dicts, which cannot be stacked."""
    return torch.stack([image for image, _ in samples]), [target for _, target in samples]
'''


def test_detection_style_lists_are_counted_as_samples(tmp_path):
    """Targets a list of dicts of 0 to 5 boxes: images are counted, not the boxes of the first image."""
    copy = copy_with_your_functions("distributed.py", tmp_path / "copy", YOUR_DETECTION_LISTS)
    out = tmp_path / "out"
    run(launch(copy, 2, *COMMON, "--output-dir", out), cwd=tmp_path)
    epochs = metrics(out)
    assert [m["val_images"] for m in epochs] == [203] * 3  # each image once
    assert all(m["val_acc"] is None for m in epochs)
    losses = [m["val_loss"] for m in epochs]
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] / 5, (
        losses
    )  # it learns to count
