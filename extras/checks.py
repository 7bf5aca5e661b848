"""One line before training for what training would trip on: the start-up step (first_step_flops: a
step of two samples, undone), the loss's form, the labels, DataLoader workers' pickles, and finite
weights before anything is saved.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode

from utils import (
    UsageError,
    batch_to_device,
    describe_value,
    errors_shared_by_all_ranks,
    first_line,
    first_samples,
    forward,
    local_ranks,
    log,
    rank,
    refused_as_one_line,
    tree_flatten,
    world_size,
)


class ModelFlops(FlopCounterMode):
    """FlopCounterMode over a backward, without the forward that activation checkpointing
    recomputes in it: model FLOPs, not the hardware's, so MFU does not rise when work is redone.
    The recompute runs with gradients enabled, the backward's own ops without. (FlopCounterMode's
    own hook for each op: a PyTorch without it counts the recompute, as FlopCounterMode does.)"""

    def _count_flops(self, func_packet, out, args, kwargs):
        if torch.is_grad_enabled():
            return out
        return super()._count_flops(func_packet, out, args, kwargs)


def returned_datasets(returned) -> tuple:
    """build_datasets' (train_set, val_set, num_classes), as it returned them; another form, or a
    set of no samples (where it has a length: a stream's is not known), ends every rank in one
    line, not in an unpacking's traceback or a validation of nothing recorded as a loss of 0."""
    if not (isinstance(returned, (tuple, list)) and len(returned) == 3):
        raise UsageError(
            "build_datasets must return (train_set, val_set, num_classes), not"
            f" {describe_value(returned)}"
        )
    if dataset_length(returned[0]) == 0:
        raise UsageError("build_datasets returned an empty training set: nothing to train on")
    if dataset_length(returned[1]) == 0:
        raise UsageError(
            "build_datasets returned an empty validation set: give it samples, each counted once"
            " (a slice of the training data will do)"
        )
    return tuple(returned)


def dataset_length(dataset) -> int | None:
    """len(dataset), or None where it has none (a stream)."""
    try:
        return len(dataset)
    except TypeError:
        return None


def returned_model(model, together: bool = False) -> nn.Module:
    """build_model's module, which must be one with a parameter to train: one line, not a
    traceback at .to() or at the first backward. Models trained together (a GAN's generator and
    discriminator: together.TrainedTogether), each its own DDP, where the script takes them."""
    if not isinstance(model, nn.Module):
        raise UsageError(f"build_model must return an nn.Module, not {describe_value(model)}")
    if getattr(model, "trained_together", False):
        check_trained_together(model, together)
    if not any(p.requires_grad for p in model.parameters()):
        raise UsageError(
            f"build_model's {type(model).__name__} has no parameter that requires a gradient:"
            " nothing to train (frozen weights need some left unfrozen, e.g. a new head)"
        )
    return model


def check_trained_together(model: nn.ModuleDict, together: bool) -> None:
    """Models trained together in a script that trains them (together), each with a parameter to
    train, none held by the container (it is in no DDP, no optimizer): one line, not a traceback."""
    name = type(model).__name__
    if not together:
        raise UsageError(
            f"build_model's {name} is models trained together (extras/together.py):"
            " distributed.py, distributed_mp.py and distributed_amp.py train each in its own DDP;"
            " this script trains one model"
        )
    if model._parameters or model._buffers:
        raise UsageError(f"build_model's {name} holds weights of its own: put them in its models")
    for part, module in model.items():
        if not any(p.requires_grad for p in module.parameters()):
            raise UsageError(f"build_model's {name}[{part!r}] has no parameter to train")


def frozen_models(models) -> None:
    """build_frozen's models, a dict of nn.Modules, their sizes said once; anything else refused in
    one line."""
    if not isinstance(models, dict) or not all(isinstance(m, nn.Module) for m in models.values()):
        raise UsageError(
            "build_frozen must return a dict of nn.Modules ({} for none), not"
            f" {describe_value(models)}"
        )
    for name, module in models.items():
        size = sum(p.numel() for p in module.parameters())
        log.info(f"frozen {name}: {size:,} parameters, not trained and in no saved file")


def first_step_flops(
    model: nn.Module,
    loader: DataLoader,
    compute_loss: Callable,
    args,
    device: torch.device,
    unused_ok: bool,
) -> tuple[float, float]:
    """The FLOPs of a sample's forward and backward, counted around the model and loss only
    (FlopCounterMode would see our own collectives too), in a step of two samples that is undone
    (in float32 whatever the training's precision: two samples are small), the convolutions'
    share of them (peaks: cuDNN's TF32 flag rules their float32 precision); on the way, what
    would fail or learn nothing ends every rank with one line. Every rank calls it."""
    devices = []
    if torch.cuda.is_available():
        devices = [torch.cuda.current_device()]
    # batch-norm statistics and the random streams put back afterwards
    with torch.random.fork_rng(devices), statistics_kept(model):
        # One rank's error ends every rank with its line; before backward(), a collective under
        # FSDP.
        with errors_shared_by_all_ranks():
            check_workers_can_take(loader)
            # Two samples for the step, more for the labels' check below (a stream's: its first
            # reader's).
            first = first_samples(loader, 256)
            # a Dataset's random state that its per-sample seeds cannot reach
            check_draws_reach(loader.dataset)
            samples, batch, more = collate_first(loader, first)
            inputs, targets = batch_to_device(batch, device, loader.dataset, args.channels_last)
            with refused_as_one_line("the model cannot take the first batch's inputs"):
                with FlopCounterMode(display=False) as forward_flops:
                    outputs = forward(model.train(), inputs)
            # On a GPU a bad label is a device-side assert that kills the process: more labels than
            # two samples have are checked.
            if is_default_loss(compute_loss):
                check_class_targets(outputs, batch_to_device(more, device, loader.dataset)[1])
            with refused_as_one_line("compute_loss cannot take the outputs and targets"):
                loss = compute_loss(outputs, targets)
            check_loss(loss)
        # on more processes than one: a loss or batch norm that each rank's part changes, said
        if world_size() > 1:
            say_what_the_split_changes(model, args, outputs, loss, samples)
        with ModelFlops(display=False) as backward_flops:
            if isinstance(loss, torch.Tensor):
                loss.backward()
            else:
                loss[0].backward()
    unused = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    model.zero_grad(set_to_none=True)
    # Alike on every rank: the same model and code. (Models trained together: the step is yours.)
    if unused and not unused_ok and not getattr(model, "trained_together", False):
        names = ", ".join(unused[:3])
        if len(unused) > 3:
            names += ", ..."
        raise UsageError(
            f"{len(unused)} parameters get no gradient ({names}): --find-unused-parameters lets DDP"
            " train such a model, or leave them out of it"
        )
    flops = forward_flops.get_total_flops() + backward_flops.get_total_flops()
    convolutions = sum(
        count
        for counter in (forward_flops, backward_flops)
        for op, count in counter.get_flop_counts()["Global"].items()
        if "convolution" in str(op)
    )
    return flops / samples, convolutions / max(flops, 1)


def check_draws_reach(dataset) -> None:
    """A Dataset whose first sample, read twice from the same seeds, differs keeps random state
    that neither the global streams nor the generators found in it reach (a generator in a closure,
    a library's own in C): one line naming it, not a run whose ranks and workers draw apart."""
    # read through a user's sampler's sets (samplers.Batches); seeded per sample: seeds.SampleSeeds
    if not hasattr(type(dataset), "read_again"):
        dataset = getattr(dataset, "dataset", None)
    if not hasattr(type(dataset), "read_again") or len(dataset) == 0:
        return
    if not alike(dataset.read(0), dataset.read(0)):
        name = type(dataset.dataset).__name__
        raise UsageError(
            f"your {name} reads sample 0 differently from the same seeds: it draws from a random"
            " state of its own that the scripts cannot reach, so ranks and workers would draw"
            " apart; keep its generator in an attribute (a NumPy Generator, a torch.Generator, a"
            " random.Random) or draw from torch's, Python's or NumPy's global streams"
        )


def alike(a, b) -> bool:
    """Are two samples the same: tensors and arrays element for element (NaN where NaN), nested
    in tuples, lists and dicts; anything else by ==."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.eq(a, b).logical_or(a.ne(a) & b.ne(b)).all())
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(alike(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(alike(a[k], b[k]) for k in a)
    if hasattr(a, "__array__") and hasattr(b, "__array__"):  # NumPy arrays, PIL images
        import numpy

        a, b = numpy.asarray(a), numpy.asarray(b)
        nan = a.dtype.kind in "fc" and b.dtype.kind in "fc"
        return a.shape == b.shape and bool(numpy.array_equal(a, b, equal_nan=nan))
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return True  # what cannot be compared is not held against the dataset


def collate_first(loader: DataLoader, first: list) -> tuple[int, object, object]:
    """(samples, batch) of the first two samples, and the batch of all of them (what a library
    refuses there is one line: batches.Counted); a batch not (inputs, targets) is one line."""
    samples, batch = loader.collate_fn(first[:2])
    more = loader.collate_fn(first)[1]
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise UsageError(
            f"collate must return one batch as (inputs, targets), not {describe_value(batch)}"
        )
    return samples, batch, more


class DiscardedBytes:
    """A file that keeps nothing: a worker's pickle is checked, not kept."""

    write = staticmethod(len)


class PicklerWithoutTensors(pickle.Pickler):
    """Tensors go to the workers through shared memory, unpickled."""

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            return id(obj)
        return None


def check_workers_can_take(loader: DataLoader) -> None:
    """DataLoader workers start from a forkserver: the Dataset and collate must pickle (no lambda,
    no open file)."""
    if not loader.num_workers:
        return
    try:
        PicklerWithoutTensors(DiscardedBytes()).dump((loader.dataset, loader.collate_fn))
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise UsageError(
            f"the Dataset or collate cannot go to a DataLoader worker ({first_line(e)}): define"
            " their functions at module level, not as a lambda or inside a function, or use"
            " --workers 0"
        ) from None


def check_loss(loss) -> None:
    """compute_loss gives a scalar (the batch's mean) or a pair (a scalar sum, its count)."""
    pair = isinstance(loss, (tuple, list)) and len(loss) == 2
    total, count = loss if pair else (loss, 1)
    scalar = isinstance(total, torch.Tensor) and total.dim() == 0
    one_count = isinstance(count, int) or (isinstance(count, torch.Tensor) and count.numel() == 1)
    if scalar and one_count and not total.requires_grad:
        raise UsageError(
            "compute_loss returned a loss with no gradient back to the weights: return it as"
            " computed from the outputs (not detached, not under torch.no_grad, in compute_loss or"
            " the model's forward)"
        )
    if scalar and one_count:
        return
    what = describe_value(loss)
    if pair:
        what = f"({describe_value(total)}, {describe_value(count)})"
    raise UsageError(
        f"compute_loss must return a scalar tensor or a (sum, count) pair, not {what}: reduce"
        " it, e.g. with .mean()"
    )


def say_what_the_split_changes(model: nn.Module, args, outputs, loss, samples: int) -> None:
    """One line each where a run on several processes trains another objective than one process:
    a loss that couples the samples of a batch (each rank computes it over its own part; not said
    of DiLoCo's local steps, each rank's own by design), batch norm in training without --sync-bn
    where the script has it."""
    diloco = hasattr(args, "outer_lr")
    whole = gathers_whole_batch(loss)
    if not diloco and not whole and loss_couples_samples(outputs, loss, samples):
        log.info(
            "compute_loss couples the samples of a batch (one sample's gradient depends on"
            " another's outputs): each rank computes it over its own part, another objective on"
            " every number of processes; batches.whole_batch over the outputs makes it the global"
            " batch's"
        )
    norms = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm)
        and not isinstance(module, nn.SyncBatchNorm)
    ]
    if norms and not getattr(args, "sync_bn", False):
        cure = "; --sync-bn makes them the global batch's"
        if not hasattr(args, "sync_bn"):
            cure = " (this script has no --sync-bn; distributed.py does)"
        log.info(
            f"batch norm ({len(norms)} layers, {norms[0]} first) normalises each rank's part of the"
            f" batch: its statistics change with the number of processes{cure}"
        )


def gathers_whole_batch(loss) -> bool:
    """Does the loss's graph hold batches.whole_batch's all-gather (its backward's node)?"""
    total = loss[0] if isinstance(loss, (tuple, list)) else loss
    nodes, seen = [total.grad_fn], set()
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        if type(node).__name__ == "WholeBatchBackward":
            return True
        seen.add(node)
        nodes.extend(after for after, _ in node.next_functions)
    return False


def loss_couples_samples(outputs, loss, samples: int) -> bool:
    """Does the first batch's loss mix its samples: the gradient at sample 0's outputs moves with
    the other samples' outputs (a second derivative of the loss alone, not of the model; zero for
    a mean or sum over samples, as cross-entropy and a token loss are), in the outputs whose dim 0
    holds the samples (as whole_batch's). A loss without a second derivative is not held against
    the user."""
    total = loss if isinstance(loss, torch.Tensor) else loss[0]
    rows = [
        t
        for t in tree_flatten(outputs)[0]
        if isinstance(t, torch.Tensor) and t.requires_grad and t.dim() > 0 and len(t) == samples > 1
    ]
    try:
        grads = torch.autograd.grad(total, rows, create_graph=True, allow_unused=True)
        # sample 0's gradient in a random direction, differentiated again
        first = sum((g[0] * torch.rand_like(g[0])).sum() for g in grads if g is not None)
        # (the loss's graph kept for the backward that follows)
        again = torch.autograd.grad(first, rows, allow_unused=True, retain_graph=True)
        again = [h for h in again if h is not None and h.numel()]
    except (RuntimeError, TypeError):
        return False
    own = max((float(h[0].abs().max()) for h in again), default=0.0)
    return max((float(h[1:].abs().max()) for h in again), default=0.0) > 1e-4 * own


def check_class_targets(outputs, targets) -> None:
    """The first batch's targets that the default loss, cross-entropy over outputs' dim 1, cannot
    mean."""
    classes = 0
    if isinstance(outputs, torch.Tensor) and outputs.dim() > 1:
        classes = outputs.shape[1]
    if classes == 1:
        raise UsageError(
            "the model gives 1 output per sample, and cross-entropy over one class is always 0: "
            "check num_classes, or replace compute_loss (a regression: F.mse_loss)"
        )
    class_indices = isinstance(targets, torch.Tensor) and not targets.is_floating_point()
    if classes and class_indices:
        low, high = int(targets.min()), int(targets.max())
        if low < 0 or high >= classes:
            raise UsageError(
                f"class labels from {low} to {high} in the first batch, outside [0, {classes}) for "
                f"the model's {classes} outputs: check num_classes, or replace compute_loss"
            )


def is_default_loss(compute_loss: Callable) -> bool:
    """Is compute_loss the default F.cross_entropy(outputs, targets), with no other name or
    constant (ignore_index=)? Read from its code object (tests/test_internals.py checks that each
    script's default is recognised)."""
    code = getattr(compute_loss, "__code__", None)
    if code is None:
        return False
    names = code.co_names == ("F", "cross_entropy")
    return names and set(code.co_consts) <= {None, compute_loss.__doc__}


def check_keep_best(args, user_metrics, num_classes: int) -> None:
    """--keep-best NAME: one line at the start where no validation will have NAME, with the names
    there are (user_metrics: scores.UserMetrics, or None)."""
    if args.keep_best is None:
        return
    metric_names = user_metrics.names() if user_metrics is not None else []
    names = ["val_loss", "val_acc", *metric_names]
    if num_classes >= 5:
        names.insert(2, "val_acc5")
    # the average's values, with --ema
    name = args.keep_best
    if args.ema is not None:
        names += [f"{n}_ema" for n in names]
        name = name.removesuffix("_ema")
    # a metric that computes a dict (torchmetrics' mAP) is recorded as val_<name>_<key>
    of_a_metric = any(name.startswith(f"{n}_") for n in metric_names)
    if args.keep_best in names or (of_a_metric and not name.endswith("_ema")):
        return
    raise UsageError(
        f"--keep-best {args.keep_best}: no validation records it; it records {', '.join(names)}"
    )


@contextlib.contextmanager
def statistics_kept(model: nn.Module):
    """The block's forwards leave the model's batch-norm statistics (all its buffers) as they were:
    a step that is undone, a forward that the step runs again."""
    saved = [buffer.clone() for buffer in model.buffers()]
    yield
    with torch.no_grad():
        for buffer, kept in zip(model.buffers(), saved):
            buffer.copy_(kept)


def check_state_fits(
    model: nn.Module, shards: int, args, place: torch.device, host_free: float, frozen: dict
) -> None:
    """FSDP's, before sharding: what each rank will hold beside the memory free for it (its GPU's
    less the frozen models' bound there, or its share of host_free, the host's available bytes); a
    state that cannot fit ends the run in one line here, not by the out-of-memory killer
    mid-step."""
    # On the meta device: sizes only.
    gigabytes = {p: p.numel() * p.element_size() / 1e9 for p in model.parameters()}
    whole = sum(gigabytes.values())
    grads = sum(size for p, size in gigabytes.items() if p.requires_grad) / shards
    state = [
        whole / shards,
        grads,
        grads * (2 if args.optimizer == "adamw" else int(args.momentum > 0)),
    ]
    # a GPU's free memory, less the frozen models' that move there next (not there already)
    if place.type == "cuda":
        tensors = [t for m in frozen.values() for t in [*m.parameters(), *m.buffers()]]
        frozen_bytes = sum(t.nbytes for t in tensors if not t.is_cuda)
        free = (torch.cuda.mem_get_info(place)[0] - frozen_bytes) / 1e9
    # what the host has available (on rank 0's node also the model rank 0 built, freed once
    # sharded), shared
    else:
        free = (host_free / 1e9 + whole * (rank() < local_ranks())) / local_ranks()
    line = (
        f"each rank will hold {sum(state):.2f} GB: parameters {state[0]:.2f}, gradients"
        f" {state[1]:.2f}, {args.optimizer} state {state[2]:.2f}; {free:.1f} GB free for it"
        f" ({place.type})"
    )
    if sum(state) > free:
        raise UsageError(
            f"{line}: it cannot fit: use more processes, --cpu-offload (GPUs) or a smaller model"
        )
    log.info(line)
