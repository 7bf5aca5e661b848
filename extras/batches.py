"""A loss over the whole global batch (contrastive learning's in-batch negatives, CLIP): a user's
compute_loss calls whole_batch on each rank's part of the outputs, which every rank then holds
whole, its gradient sent back to each part (WholeBatch). With accumulation, extras/gradcache.py
steps over all of a step's micro-batches for it.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from utils import UsageError, world_size


class WholeBatch(torch.autograd.Function):
    """All ranks' parts of a batch tensor, in rank order (sizes: each one's samples); backward:
    the gradient at the whole summed over the ranks, this rank's part of it. Each rank's loss over
    the whole batch the same, weighted by its part (the weights add up to the world size), DDP's
    mean of the ranks' gradients is then one process's."""

    calls = 0  # whole_batch's, in this process: distributed_grad_accum.py's main() reads it

    @staticmethod
    def forward(ctx, part: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        ctx.sizes = sizes
        padded = part.new_zeros((max(sizes), *part.shape[1:]))
        padded[: len(part)] = part
        gathered = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(gathered, padded)
        return torch.cat([rows[:size] for rows, size in zip(gathered, sizes)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # a copy: autograd may hand the same gradient to another input
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad)  # every rank's loss reaches this rank's samples through it
        start = sum(ctx.sizes[: dist.get_rank()])
        return grad[start : start + ctx.sizes[dist.get_rank()]], None


def whole_batch(part: torch.Tensor) -> torch.Tensor:
    """The global batch of a tensor whose dim 0 holds this rank's samples (its part of a batch's
    embeddings, say): every rank's part, rank 0's first, of any sizes (a rank with none too), and
    the gradient back to each rank's own. A loss of it is the whole batch's, the same on every rank
    (a contrastive loss's negatives: all of the batch), and run.backward() makes the gradient one
    process's; a (sum, count) of it counts the whole batch's items, the same on every rank. On one
    process: part itself. Every rank calls it, as often, in training and
    validation (all-gathers)."""
    WholeBatch.calls += 1
    if not 1 <= part.dim() <= 10:
        raise UsageError(
            f"whole_batch takes a tensor of a batch's samples, not {tuple(part.shape)}"
        )
    if world_size() == 1:
        return part
    # every rank's shape and dtype: parts that cannot join end every rank with one line
    dtype = DTYPES.index(part.dtype) if part.dtype in DTYPES else len(DTYPES)
    shape = torch.zeros(12, dtype=torch.int64, device=part.device)
    shape[: part.dim() + 2] = torch.tensor([part.dim(), dtype, *part.shape])
    shapes = [torch.empty_like(shape) for _ in range(world_size())]
    dist.all_gather(shapes, shape)
    shapes = [row.tolist() for row in shapes]
    if any(row[:2] + row[3:] != shapes[0][:2] + shapes[0][3:] for row in shapes):
        caller = traceback.extract_stack(limit=2)[0]
        dtypes = [str(dtype).removeprefix("torch.") for dtype in DTYPES] + ["another dtype"]
        described = ", ".join(f"{row[3 : 2 + row[0]]} {dtypes[row[1]]}" for row in shapes)
        raise UsageError(
            f"whole_batch at {Path(caller.filename).name}:{caller.lineno}: the ranks' parts differ"
            f" beyond their samples (dim 0): {described}"
        )
    return WholeBatch.apply(part.contiguous(), [row[2] for row in shapes])


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]
