"""Any batch of any task: counted as the samples collate received (Counted), moved to the device
(batch_to_device), passed to the model (forward), its loss made a gradient's (loss_for_backward;
a token count summed over the ranks); a loss over the whole batch (whole_batch), over a whole step
of micro-batches (Joined); an epoch's loader (epoch_loader, steps_per_epoch, first_samples).
"""

from __future__ import annotations

import functools
import itertools
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from utils import OURS, UsageError, raised_in, refused_as_one_line
from .internals import tree_flatten, tree_map_only, tree_unflatten
from utils import all_reduce, share, world_size
from .samplers import Batches


class Counted:
    """Counted(collate): a collate_fn giving (samples, batch), any batch counted as its samples
    (pickled to the workers with the collate it holds). What a library refuses in collate
    (default_collate: samples of two sizes) is one line at the user's line, at the start-up check
    or mid-epoch, in a worker or not (errors.refused_as_one_line); an error collate raises itself
    is the user's."""

    def __init__(self, collate: Callable[[list], object]):
        self.collate = collate

    def __call__(self, samples: list) -> tuple[int, object]:
        with refused_as_one_line("collate cannot batch its samples", then="; pad them"):
            return len(samples), self.collate(samples)


def forward(model: nn.Module, inputs):
    """A dict of inputs as keyword arguments, as Hugging Face models take them; anything else as
    one argument."""
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(inputs)


class WholeBatch(torch.autograd.Function):
    """All ranks' parts of a batch tensor, in rank order (sizes: each one's samples); backward:
    the gradient at the whole summed over the ranks, this rank's part of it. Each rank's loss over
    the whole batch the same, weighted by its part (the weights add up to the world size), DDP's
    mean of the ranks' gradients is then one process's."""

    calls = 0  # whole_batch's, in this process: distributed_grad_accum.py's step reads it

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
    process's. On one process: part itself. Every rank calls it, as often, in training and
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


class Joined:
    """A step's micro-batches' outputs (or targets) as one batch's, .whole, for a loss over the
    whole step (GradCache; open_clip's --accum-freq): a tensor of a row per sample concatenated,
    any other (a learned temperature) the first micro-batch's, which must be each one's. grad: each
    floating-point tensor a leaf that the loss's backward leaves its gradient at, which
    backward(i, outputs) sends back through micro-batch i's outputs computed again. The other
    tensors are compared in the run's first step only (a GPU value read back), whose outputs are
    made as every step's are."""

    compared = False  # the first step's outputs (grad) were compared

    def __init__(self, parts: list, samples: list[int], grad: bool = False):
        self.samples = samples
        flat = [tree_flatten(part) for part in parts]
        if any(spec != flat[0][1] for _, spec in flat):
            raise UsageError("the micro-batches' outputs differ in structure: they cannot join")
        self.leaves, self.per_sample = [], []
        for tensors in zip(*[leaves for leaves, _ in flat]):
            whole = tensors[0]
            per_sample = all(
                isinstance(t, torch.Tensor) and t.dim() > 0 and len(t) == n
                for t, n in zip(tensors, samples)
            )
            if per_sample:
                whole = torch.cat(tensors)
            elif (
                not Joined.compared
                and isinstance(whole, torch.Tensor)
                and any(not whole.equal(t) for t in tensors)
            ):
                raise UsageError(
                    f"a {tuple(whole.shape)} tensor of the outputs is neither a row per sample nor"
                    " the same in every micro-batch: a loss over the whole step cannot join it"
                )
            if grad and isinstance(whole, torch.Tensor):
                whole = whole.detach().requires_grad_(whole.is_floating_point())
            self.leaves.append(whole)
            self.per_sample.append(per_sample)
        self.whole = tree_unflatten(self.leaves, flat[0][1])
        Joined.compared = Joined.compared or grad

    def backward(self, i: int, outputs) -> None:
        """Micro-batch i's backward from its rows of the gradient at .whole (from the other
        tensors' whole gradient in the last micro-batch, whose backward DDP all-reduces in)."""
        start = sum(self.samples[:i])
        last = i == len(self.samples) - 1
        tensors, grads = [], []
        for again, whole, per_sample in zip(tree_flatten(outputs)[0], self.leaves, self.per_sample):
            if not isinstance(whole, torch.Tensor) or whole.grad is None:
                continue
            if per_sample:
                tensors.append(again)
                grads.append(whole.grad[start : start + self.samples[i]])
            elif last:
                tensors.append(again)
                grads.append(whole.grad)
        if tensors:
            torch.autograd.backward(tensors, grads)


def loss_for_backward(loss, samples: int, batch_size: int):
    """compute_loss's mean weighted by this rank's samples of the step's batch_size (x world size:
    DDP and FSDP average the ranks' gradients), so that ranks whose parts differ by a sample give
    the gradient of the whole batch's mean; as it is where the parts are equal. Its (sum, count)
    as sum x world size / all ranks' count (one small all-reduce, every rank), whatever each rank's
    count."""
    if isinstance(loss, torch.Tensor):
        weight = samples * world_size() / batch_size
        if weight == 1:
            return loss
        return loss * weight
    total, count = loss
    count = all_reduce(count_to_device(count, total.device))
    return total * (world_size() / count.clamp(min=1)).to(total.dtype)


class GlobalBatchShares(DistributedSampler):
    """DistributedSampler for a global batch that the ranks do not divide: one shuffle per epoch,
    alike on every rank (set_epoch), cut into global batches of batch_size (micro_batches of them a
    step under accumulation); rank r takes samples r, r + W, ... of each, its share within one
    sample of the others' (ranks.share). Full steps only. Where the batch divides, its samples are
    DistributedSampler's with drop_last."""

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int = 0,
        micro_batches: int = 1,
    ):
        super().__init__(dataset, world_size, rank, shuffle=True, seed=seed)
        self.batch_size = batch_size
        self.batches = len(dataset) // (batch_size * micro_batches) * micro_batches
        self.num_samples = self.batches * share(batch_size, rank, world_size)

    def __iter__(self):
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.dataset), generator=generator).tolist()
        for start in range(0, self.batches * self.batch_size, self.batch_size):
            yield from order[start + self.rank : start + self.batch_size : self.num_replicas]


def logits(outputs):
    """The scores in outputs: themselves, or the logits of a dict or a Hugging Face ModelOutput."""
    if isinstance(outputs, Mapping):
        return outputs.get("logits")
    return getattr(outputs, "logits", outputs)


def class_indices(outputs, targets) -> bool:
    """Are targets class indices for scores at outputs' dim 1 (classification, per-pixel
    classification)?"""
    if not (isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor)):
        return False
    whole_numbers = not (
        targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool
    )
    one_score_each = outputs.shape[:1] + outputs.shape[2:] == targets.shape
    return (
        outputs.is_floating_point()
        and whole_numbers
        and outputs.dim() == targets.dim() + 1
        and one_score_each
    )


def batch_to_device(
    batch,
    device: torch.device,
    dataset: Dataset,
    channels_last: bool = False,
    key: tuple[int, int] | None = None,
):
    """(inputs, targets) of any structure on the device. A dataset with a batch_transform(inputs,
    key) has it finish the inputs there, key (epoch, step) for a training batch and None for a
    validation one: the built-in images' fast path (builtin); a user's Dataset has none."""
    inputs, targets = batch
    if isinstance(inputs, torch.Tensor) and isinstance(targets, torch.Tensor):
        inputs, targets = to_device(inputs, device), to_device(targets, device)
    else:
        # A tokenizer's BatchEncoding goes in as a plain dict.
        if isinstance(inputs, Mapping):
            inputs = dict(inputs)
        inputs, targets = tree_map_only(
            torch.Tensor, functools.partial(to_device, device=device), (inputs, targets)
        )
    transform = getattr(dataset, "batch_transform", None)
    if transform is not None:
        inputs = transform(inputs, key)
    if channels_last and isinstance(inputs, torch.Tensor) and inputs.dim() == 4:
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    return inputs, targets


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """tensor on device, the host not waiting for the copy: to a GPU from pinned memory (the
    DataLoader's pin_memory pins a batch already; a tensor made on the host is pinned here)."""
    if device.type == "cuda" and not tensor.is_cuda and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def count_to_device(count, device: torch.device) -> torch.Tensor:
    """A count (a Python number, or a tensor anywhere) as a new float64 tensor on device, copied
    without a wait."""
    if isinstance(count, torch.Tensor):
        return count.to(device, torch.float64, non_blocking=True, copy=True)
    return to_device(torch.tensor(count, dtype=torch.float64), device)


def steps_per_epoch(loader: DataLoader, args, micro_batches: int = 1) -> int:
    """Optimizer steps in an epoch: the loader's full batches, cut at --steps-per-epoch (which a
    stream without __len__ needs)."""
    try:
        batches = len(loader) // micro_batches
    except TypeError as e:
        # A TypeError in the stream's own __len__ is the user's error.
        if not raised_in(e, *OURS):
            raise
        # A stream without __len__: an epoch is one pass, cut at N steps.
        if not args.steps_per_epoch:
            raise UsageError(
                "the training set is a stream without __len__: give --steps-per-epoch N, the "
                "optimizer steps of an epoch"
            ) from None
        batches = args.steps_per_epoch
    if args.steps_per_epoch:
        return min(batches, args.steps_per_epoch)
    return batches


def epoch_loader(loader: DataLoader, epoch: int, skip: int) -> DataLoader:
    """The loader for this epoch (call its sampler's set_epoch first): a dataset with set_epoch is
    told the epoch (the built-in image folder draws its crops from it); continued mid-epoch,
    without its first skip batches."""
    if hasattr(loader.dataset, "set_epoch"):
        loader.dataset.set_epoch(epoch)
    if not skip:
        return loader
    # The indices after them in this epoch's order; a stream's batches are read again, not
    # collated.
    rest = itertools.islice(loader.sampler, skip * (loader.batch_size or 1), None)
    return DataLoader(
        loader.dataset,
        loader.batch_size,
        sampler=rest,
        drop_last=loader.drop_last,
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        generator=loader.generator,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
    )


def first_samples(loader: DataLoader, n: int) -> list:
    """The first n samples of this rank's loader (a stream's first): for the start-up step, or a
    spare batch."""
    # A stream's sampler (streams.StreamSampler) reads them from the stream.
    if hasattr(loader.sampler, "first"):
        return loader.sampler.first(n)
    # A share of nothing (a validation sampler with no index) takes the first of the set.
    indices = loader.sampler or range(len(loader.dataset))
    dataset = loader.dataset
    # A user's sampler's shares are lists of (index, repeat), which samplers.Batches reads.
    if isinstance(dataset, Batches):
        drawn = itertools.chain.from_iterable(indices)
        return [dataset.read(index, repeat) for index, repeat in itertools.islice(drawn, n)]
    return [dataset[i] for i in itertools.islice(indices, n)]
