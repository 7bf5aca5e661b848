"""The language-model workload of the benchmark (tools/benchmark.py --lm), alike in every row: GPT-2 built from its
config (no download; its size from LM_LAYERS, LM_WIDTH, LM_HEADS, LM_LENGTH, LM_VOCAB), trained on sequences of
LM_LENGTH tokens, each an arithmetic progression modulo the vocabulary (learnable: the loss falls), by next-token
cross-entropy. The scripts' plug points (YOURS) and the peers' loops (tools/lm_peers.py) import it."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel


def size() -> dict[str, int]:
    """The model's and sequences' size: a few layers by default (a CPU's), GPT-2 small's with the GPU's settings."""
    names = ("LM_LAYERS", "LM_WIDTH", "LM_HEADS", "LM_LENGTH", "LM_VOCAB")
    defaults = (2, 128, 4, 64, 512)
    return {name: int(os.environ.get(name, default)) for name, default in zip(names, defaults)}


def gpt2() -> GPT2LMHeadModel:
    """GPT-2 of size(), its head tied to its token embedding, dropout off (every row draws alike)."""
    s = size()
    config = GPT2Config(
        n_layer=s["LM_LAYERS"],
        n_embd=s["LM_WIDTH"],
        n_head=s["LM_HEADS"],
        n_positions=s["LM_LENGTH"],
        vocab_size=s["LM_VOCAB"],
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def flops_per_token() -> float:
    """A token's training FLOPs as nanoGPT and the PaLM paper count them: 6N (N the parameters but the position
    embeddings) plus attention's 12 L T d."""
    s = size()
    model = gpt2()
    parameters = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
    return 6 * parameters + 12 * s["LM_LAYERS"] * s["LM_LENGTH"] * s["LM_WIDTH"]


class Sequences(torch.utils.data.Dataset):
    """count sequences of LM_LENGTH tokens: a, a + d, a + 2d, ... modulo LM_VOCAB."""

    def __init__(self, count: int, seed: int):
        s = size()
        generator = torch.Generator().manual_seed(seed)
        start = torch.randint(0, s["LM_VOCAB"], (count, 1), generator=generator)
        step = torch.randint(1, 8, (count, 1), generator=generator)
        self.ids = (start + step * torch.arange(s["LM_LENGTH"])) % s["LM_VOCAB"]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.ids[index]


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Next-token cross-entropy summed over the predicted tokens, and their count."""
    predicted, labels = logits[:, :-1].float(), ids[:, 1:]
    return F.cross_entropy(predicted.transpose(1, 2), labels, reduction="sum"), labels.numel()


# the scripts' plug points for this workload (lm_workload.py copied beside the script)
YOURS = """
from lm_workload import Sequences, gpt2, next_token_loss, size


def build_datasets(args):
    return Sequences(args.fake_size, 1), Sequences(args.fake_size // 8, 2), size()["LM_VOCAB"]


def build_model(args, num_classes):
    return gpt2()


def compute_loss(outputs, targets):
    return next_token_loss(outputs.logits, targets)


def collate(samples):
    ids = torch.stack(samples)
    return {"input_ids": ids}, ids
"""
