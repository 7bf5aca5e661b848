"""Fully sharded data parallel (FSDP2): the model state sharded over all processes.

    torchrun --standalone --nproc_per_node=8 distributed_fsdp.py \\
        --optimizer adamw --amp-dtype bfloat16
    # CPU, gloo:
    torchrun --standalone --nproc_per_node=2 distributed_fsdp.py --dataset fake --arch tiny

DDP keeps the whole model, its gradients and its optimizer state on every GPU; FSDP keeps 1/N of
each on each of N GPUs. A block's weights are all-gathered just before its forward (and again
before its backward) and freed after; its gradients are reduce-scattered, so that each rank
updates only its shard. Every rank still trains on its own share of every batch: data
parallelism, with the model's memory spread over the GPUs. Checkpoints are sharded too: every
rank writes its part of checkpoint/, and any number of processes can continue from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import shutil
import sys
import tempfile
from contextlib import ExitStack, nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, default_collate

import utils
from extras import (
    checkpoints,
    metrics,
)
from utils import UsageError, log

# ---- your data, model and task: replace these four bodies (and the three after them when your
# project samples, measures or uses a frozen model in its own way), and the steps if you like ----


def build_datasets(args):
    """(train_set, val_set, num_classes): map-style Datasets of samples that collate() makes batches
    of."""
    # --dataset imagefolder: torchvision's recipe (extras/images.py)
    if args.dataset == "imagefolder":
        from extras import images

        return images.datasets(args)
    # --dataset: CIFAR or fake images (extras/builtin.py)
    from extras import builtin

    return builtin.datasets(args)


def build_model(args, num_classes: int) -> nn.Module:
    """Any nn.Module. It gets a batch's inputs (a dict as keyword arguments, as Hugging Face models
    take them); what it returns (a tensor, a dict, a ModelOutput) goes to compute_loss as it is."""
    from extras import builtin  # --arch: tiny or a torchvision classifier

    return builtin.model(args.arch, num_classes, args.image_size)


def compute_loss(outputs, targets):
    """The batch's mean loss, a scalar; or a pair (sum, count), a sum of per-item losses (tokens,
    pixels) and how many items it sums, for the exact mean over all ranks. Accuracy is logged where
    targets are class indices.
    """
    # scores at dim 1: classification, per-pixel classification
    return F.cross_entropy(outputs, targets)


def collate(samples: list):
    """One batch (inputs, targets) from a list of samples, each a tensor or a tuple, list or dict of
    tensors (nested): stacked here; pad samples of different lengths (text) in your own."""
    return default_collate(samples)


def build_sampler(args, train_set):
    """None: a new shuffle each epoch. Or what one process would sample train_set with: a sampler
    of indices, e.g. WeightedRandomSampler(weights, len(weights)) for imbalanced classes, or a
    batch sampler whose batches are global batches of any size (length buckets, a token budget).
    Every rank draws it alike from (--seed, epoch), however it draws, and takes its share of each
    global batch, so that any number of processes trains what one does (docs/your-project.md)."""
    return None


def build_metrics(args, num_classes: int) -> dict:
    """{}: loss and accuracy (and top-5 accuracy from 5 classes). Or torchmetrics metrics, e.g.
    {"f1": MulticlassF1Score(num_classes, average="macro")} or a MetricCollection, updated with
    each validation batch's (scores, targets) and computed over every sample once on any number of
    processes: recorded as val_f1."""
    return {}


def build_frozen(args, num_classes: int) -> dict:
    """{}: none. Or models your train_step uses and does not train, e.g. {"teacher": ...} for
    distillation or a DPO reference, reached as run.frozen["teacher"]: each on the device, in
    eval mode and without gradients, in no optimizer and no saved file."""
    return {}


def train_step(run: Training, inputs, targets) -> dict:
    """One optimizer step on this rank's part of the global batch: what the loop records of it (the
    loss, the outputs its accuracy is scored on, the gradients' norm). Rewrite it for
    a step of your own (docs/your-project.md), keeping GradScaler's calls: run.backward() scales the
    loss, so the gradients are unscaled before clipping, and scaler.step() and scaler.update()
    take the optimizer's step."""
    model, optimizer, scaler = run.model, run.optimizer, run.scaler
    outputs = utils.forward(model, inputs)
    loss = compute_loss(outputs, targets)
    # loss.backward() of the scaled loss, weighted by this rank's part of the batch: exact for a
    # (sum, count) loss and for parts of unequal size; FSDP reduce-scatters each block's gradients
    # meanwhile: every rank keeps the mean gradient of its own shard
    run.backward(loss)
    scaler.unscale_(optimizer)  # the true gradients clipped and measured, not the scaled ones
    # the norm before clipping, over all shards (a DTensor, all-reduced where it is recorded)
    if run.args.clip_grad:
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), run.args.clip_grad)
    else:  # measured only: the gradients are left as they are
        grad_norm = nn.utils.get_total_norm(
            p.grad for p in model.parameters() if p.grad is not None
        )
    # each rank updates its shard; float16: skipped on every rank if one overflowed; the
    # optimizer's phase, also of a step GradScaler skips (its step hook would not run)
    run.recorder.phases.enter("optimizer")
    scaler.step(optimizer)
    scaler.update()
    # freed now: the next forward, validation and saves need no gradients
    optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()  # per optimizer step: the warm-up, then the cosine decay
    return dict(loss=loss, outputs=outputs, grad_norm=grad_norm)


def eval_step(run: Training, model: nn.Module, inputs, targets) -> tuple:
    """One validation batch, without gradients: (its loss, the outputs scored for accuracy and your
    metrics). Rewrite it for a validation that needs more than compute_loss(outputs, targets): the
    inputs, a frozen model (run.frozen["reference"])."""
    outputs = utils.forward(model, inputs)
    return compute_loss(outputs, targets), outputs


# ---- the approach ----


def parse_args():
    parser = utils.build_parser(__doc__.splitlines()[0])
    # the deprecated torch.distributed.launch passes one of these; LOCAL_RANK wins
    parser.add_argument(
        "--local-rank",
        "--local_rank",
        type=int,
        default=0,
        help="set by torch.distributed.launch; read from LOCAL_RANK otherwise",
    )
    parser.add_argument(
        "--amp-dtype",
        choices=["float16", "bfloat16"],
        default=None,
        help="compute in this precision (FSDP's MixedPrecisionPolicy; default: none, float32"
        " throughout)",
    )
    parser.add_argument(
        "--init-scale",
        type=float,
        default=2.0**16,
        help="the gradient scaler's first loss scale (float16 only)",
    )
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="each sharding unit recomputes its activations in backward: less memory, more compute",
    )
    parser.add_argument(
        "--cpu-offload",
        action="store_true",
        help=(
            "parameters, gradients and optimizer state in host memory (when 1/N of it exceeds a"
            " GPU)"
        ),
    )
    parser.add_argument(
        "--replicate",
        type=int,
        default=1,
        metavar="N",
        help="hybrid sharding: N replicas, each sharded over world size / N ranks (a node's GPUs)",
    )
    args = utils.check_args(parser.parse_args())
    if not args.init_scale > 0:
        parser.error("--init-scale must be > 0")
    # FSDP2 shards contiguous parameters only, and channels_last weights are not
    if args.channels_last:
        parser.error("--channels-last: FSDP shards contiguous weights only; use distributed.py")
    return args


def setup_distributed(args) -> tuple[int, int, int, torch.device]:
    """Join the process group: (rank, local rank, world size, device)."""
    # srun without torchrun: RANK, WORLD_SIZE and LOCAL_RANK from Slurm's variables
    if "SLURM_PROCID" in os.environ and "RANK" not in os.environ:
        from extras import slurm

        slurm.set_ranks(args.port)
    # torchrun's RANK, WORLD_SIZE and LOCAL_RANK; a world of one without them
    rank, local_rank, world_size = utils.from_environment(args)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)  # before any CUDA work, or all ranks crowd GPU 0
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        utils.set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    backend = args.backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl":
        # NCCL's Flight Recorder: each rank's last collectives, for a stalled rank's stalls/ folder
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    # offloaded gradients: their norm is all-reduced on the CPU
    if args.cpu_offload and backend == "nccl":
        backend = "cpu:gloo,cuda:nccl"
    # --dist-url, --ip and --port, env:// under torchrun; else a store of this process's own
    init_method = utils.init_method(args)
    timeout = timedelta(seconds=args.timeout)
    with utils.init_errors_as_one_line(init_method):
        store = utils.rendezvous_store(init_method, rank, world_size, timeout)
        # torchrun's store outlives a restart of its workers: a part no earlier group wrote to
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            from extras import elastic

            store = elastic.fresh_namespace(store, rank, world_size, timeout)
        # device_id binds the group to this GPU: no guessing (and warning) at barrier()
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            # the watchdog names a stalled rank first (extras/stalls.py's GRACE)
            timeout=timeout + timedelta(seconds=30),
            device_id=device if "nccl" in backend else None,
        )
    # FSDP averages the gradients with reduce_scatter(AVG): PyTorch 2.8's gloo sums instead
    if device.type == "cpu":
        utils.check_gloo_averages(world_size)
    return rank, local_rank, world_size, device


def build_loaders(
    train_set, val_set, batch_per_rank: int, args, rank: int, world_size: int, device
) -> tuple[DataLoader, DataLoader]:
    # each batch comes as (samples, batch): counted as the samples collate received, whatever its
    # structure
    common = dict(
        collate_fn=utils.Counted(collate),
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        persistent_workers=args.workers > 0,
        # the workers' seeds from (seed, rank), different on each rank: the global random stream
        # stays the model's
        generator=torch.Generator().manual_seed(utils.derive(args.seed, "workers", rank)),
    )
    # --workers N: they start from a forkserver, not a fork of this process, whose threads (gloo's)
    # could deadlock a forked child; they leave SIGTERM to this process, which stops at a step all
    # ranks agree on and saves, and end with it (extras/workers.py)
    if args.workers:
        from extras import workers

        common.update(
            worker_init_fn=workers.init_worker,
            multiprocessing_context=workers.worker_start(args.workers),
        )
    # your sampler (build_sampler), or None: ours shuffles
    user_sampler = build_sampler(args, train_set)
    # each sample's random transforms (yours too) drawn from (seed, epoch, index), a stream's
    # from its place in it: alike on any number of processes and workers, and when continued
    # (extras/seeds.py; --no-sample-seeds leaves them to the DataLoader's own streams)
    seeded = common
    if not args.no_sample_seeds:
        from extras import seeds

        train_set = seeds.per_sample(train_set, args.seed)
        val_set = seeds.per_sample(val_set, args.seed)
        # the training collate's draws (MixUp, CutMix) from its batch's place: alike with any
        # number of workers and when continued
        seeded = dict(
            common, collate_fn=seeds.SeededCollate(common["collate_fn"], train_set, args.seed, rank)
        )
    if user_sampler is not None:
        # yours, drawn whole on every rank from (seed, epoch) as one process draws it: each rank
        # its share of every global batch, read as one batch, a sample drawn again in the epoch as
        # its repeat (one line if its ranks would draw differently)
        from extras import samplers

        samplers.check_not_a_stream(user_sampler, train_set)  # one line for a stream
        train_sampler = samplers.DrawnShares(
            user_sampler, args.batch_size, rank, world_size, args.seed
        )
        train_sampler.check_drawn_alike()  # all-gather, every rank
        train_loader = DataLoader(
            samplers.Batches(train_set), None, sampler=train_sampler, **seeded
        )
    elif isinstance(train_set, IterableDataset):
        # a stream is read here (extras/streams.py): each rank its part of every global batch,
        # lists of samples the workers collate (so they never read the stream, which cannot split
        # itself twice)
        from extras import streams

        train_sampler = streams.StreamSampler(
            train_set,
            args.batch_size,
            rank,
            world_size,
            seed=args.seed,
            seeded=None if args.no_sample_seeds else seeds.sample_streams,
        )
        train_loader = DataLoader(streams.Samples(), None, sampler=train_sampler, **common)
    else:
        # each rank a different shard, shuffled alike on all ranks (set_epoch); the remainder is
        # dropped so that every rank takes the same number of steps
        if args.batch_size % world_size == 0:
            train_sampler = DistributedSampler(
                train_set, world_size, rank, shuffle=True, seed=args.seed, drop_last=True
            )
        else:
            # a batch the ranks do not divide (an elastic run on any world size): each rank takes
            # every W-th sample of each global batch, its share within one of the others'
            from extras import elastic

            train_sampler = elastic.GlobalBatchShares(
                train_set, args.batch_size, rank, world_size, args.seed
            )
        train_loader = DataLoader(
            train_set,
            batch_per_rank,
            sampler=train_sampler,
            drop_last=True,
            **seeded,
        )
    # validation: rank r takes images r, r+W, r+2W, ..., in one process's batches (of a stream: its
    # part of each global batch, or its own shards): every image exactly once (DistributedSampler
    # would pad the last shard with repeated images)
    if isinstance(val_set, IterableDataset):
        from extras import streams

        val_sampler = streams.StreamSampler(
            val_set,
            args.batch_size,
            rank,
            world_size,
            train=False,
            seed=args.seed,
            seeded=None if args.no_sample_seeds else seeds.sample_streams,
        )
        val_loader = DataLoader(streams.Samples(), None, sampler=val_sampler, **common)
    else:
        val_loader = DataLoader(
            val_set,
            batch_sampler=utils.ValidationShares(
                range(rank, len(val_set), world_size), args.batch_size
            ),
            **common,
        )
    return train_loader, val_loader


def sharding_units(model: nn.Module) -> list[nn.Module]:
    """The blocks to shard one by one: the entries of each outermost nn.ModuleList or nn.Sequential
    that hold parameters (transformer layers, a ResNet stage's blocks, a Sequential's layers). An
    entry that shares a parameter with a module outside it (a language model's head tied to its
    embedding) stays with the root.
    """
    # each parameter, and every name it is registered under
    owners: dict[nn.Parameter, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        owners.setdefault(parameter, []).append(name)
    units, containers = [], []
    for name, module in model.named_modules():
        # "" is the root: all is inside it
        inside = any(name.startswith(c + ".") or not c for c in containers)
        if inside or not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        containers.append(name)
        for child_name, child in module.named_children():
            prefix = f"{name}.{child_name}." if name else f"{child_name}."
            parameters = list(child.parameters())
            if parameters and all(n.startswith(prefix) for p in parameters for n in owners[p]):
                units.append(child)
    return units


def build_once(args, num_classes: int, rank: int) -> nn.Module:
    """build_model on rank 0; on the others on the meta device (shapes, no memory), where it can
    build so (a from_pretrained cannot: build from the config on ranks > 0, docs/fsdp.md). Every
    rank then has the random streams that rank 0's build left, as if each had built the model
    itself."""
    model = None
    if rank > 0:
        try:
            with torch.device("meta"):
                model = build_model(args, num_classes)
        except Exception as e:  # a user's code: any type; built as on rank 0, still trained
            log.warning(
                f"build_model cannot build on the meta device ({utils.first_line(e)}): rank {rank}"
                " builds the whole model in memory"
            )
    if model is None:
        model = build_model(args, num_classes)
    torch.set_rng_state(utils.all_gather_objects(torch.get_rng_state())[0])  # rank 0's
    return model


def shard_model(
    model: nn.Module, amp_dtype: torch.dtype | None, mesh: DeviceMesh, args
) -> nn.Module:
    """fully_shard each block, then the root (what is left: embeddings, a head). Replace it to
    choose other units."""
    units = sharding_units(model)
    # non-reentrant: the random state (dropout) is replayed in the recompute
    if args.activation_checkpointing:
        # a Hugging Face model checkpoints its own layers
        if hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        else:
            # FSDP2's composable checkpoint: hooks rather than a wrapper module, so that the state
            # dict's keys stay plain (a private module: tests/test_internals.py)
            from torch.distributed._composable import checkpoint

            for block in units:
                checkpoint(block)
    # compute in amp_dtype; gradients reduced and weights kept in float32; the root's outputs in
    # float32 for the loss; --cpu-offload: shards in host memory, each block copied to the GPU for
    # its forward and backward
    offload = (
        CPUOffloadPolicy() if args.cpu_offload and mesh.device_type == "cuda" else OffloadPolicy()
    )
    for block in units:
        fully_shard(
            block,
            mesh=mesh,
            mp_policy=MixedPrecisionPolicy(amp_dtype, torch.float32),
            offload_policy=offload,
        )
    return fully_shard(
        model,
        mesh=mesh,
        offload_policy=offload,
        mp_policy=MixedPrecisionPolicy(
            amp_dtype, torch.float32, output_dtype=torch.float32 if amp_dtype else None
        ),
    )


@dataclasses.dataclass
class Training:
    """What the loop works with, built once in main()."""

    args: argparse.Namespace
    model: nn.Module  # its blocks and itself sharded by fully_shard
    frozen: dict[str, nn.Module]  # build_frozen's, e.g. run.frozen["teacher"]: not trained
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler  # float16: the loss scale; off otherwise
    ema: object | None  # --ema: the weights' moving average (extras/averages.py), or None
    train_loader: DataLoader
    val_loader: DataLoader
    device: torch.device
    stop: utils.StopSignal  # the step every rank stops, or saves, after
    watchdog: object  # a stalled rank ends every rank, named (stalls.Watchdog; or NoWatchdog)
    saves: checkpoints.Saves  # every rank's shards, written while training goes on
    save_group: dist.ProcessGroup  # the sharded save's collectives, run by the writing thread
    recorder: metrics.StepRecords  # steps.jsonl and its sinks, all ranks' numbers
    val_metrics: object | None  # build_metrics' (extras/scores.py): every sample counted once
    samples: tuple[int, int] = (0, 0)  # the step's: this rank's, all ranks'
    weighted: tuple[int, int] | None = None  # the samples run.backward() last weighted by

    def backward(self, loss, **kwargs) -> None:
        """loss.backward(), compute_loss's mean weighted by this rank's part of the step's samples,
        its (sum, count) by all ranks' count: the gradient of the whole batch's mean, also where
        the ranks' parts differ in size. Keyword arguments go to .backward() (retain_graph=True)."""
        self.weighted = self.samples
        self.scaler.scale(utils.loss_for_backward(loss, *self.samples)).backward(**kwargs)


def train_one_epoch(run: Training, epoch: int, steps_done: int) -> dict:
    """The epoch's steps after steps_done (a run continued mid-epoch); its record over all ranks.
    Every rank takes the same steps."""
    args, recorder = run.args, run.recorder
    run.model.train()
    # a new shuffle each epoch, the same on all ranks (a stream's too)
    run.train_loader.sampler.set_epoch(epoch)
    # continued mid-epoch: the same order without the batches trained on (the epoch told to the
    # dataset: an image folder's crops), and the sums the checkpoint kept
    loader = utils.epoch_loader(run.train_loader, epoch, steps_done)
    meter = recorder.meter_for_epoch(run.device, steps_done)
    # every rank takes the same steps (a small all-reduce a step): a stream that ends unevenly
    # stops all after the same one; --steps-per-epoch may cut an epoch
    for step, (samples, batch) in run.stop.steps(
        meter.timed(loader), steps_done, recorder.steps_per_epoch
    ):
        run.watchdog.batch(epoch, step)  # progress: the watchdog times the steps
        recorder.phases.new_step()  # its first optimizer step counts it, once
        # dropout and other randomness in the model: this rank's own, from (seed, rank, epoch,
        # step), as one process draws its own for each sample
        utils.seed_step(args.seed, epoch, step)
        # this rank's samples and all ranks' (--batch-size, or your sampler's): run.backward()
        # weights the loss by them
        run.samples = (
            samples,
            utils.samples_in_step(run.train_loader.sampler, step, args.batch_size),
        )
        # on the device; its random draws keyed by (epoch, step)
        inputs, targets = utils.batch_to_device(
            batch, run.device, loader.dataset, args.channels_last, key=(epoch, step)
        )
        result = train_step(run, inputs, targets)
        # a loss not weighted by this rank's part (loss.backward()), wrong where the parts differ:
        # one line
        if run.weighted is not run.samples:
            raise utils.UsageError(
                "train_step did not call run.backward(): a plain loss.backward() is wrong where the"
                " ranks' parts of a batch differ"
            )
        if run.ema is not None:  # --ema: the average of each rank's own shards moves toward them
            run.ema.update()
        # its loss and accuracy added up, and the other numbers it returned
        meter.add_step(result, samples, targets)
        # as the step began: SIGTERM or SIGUSR1 on any rank, or no next batch on one, stops all
        # after this step
        signum, last = run.stop.agreed()
        # a record every --print-freq steps and at the end (all-reduces, every rank); a diverged
        # run stops here
        if step % args.print_freq == 0 or last:
            recorder.train(epoch, step, run.model, run.optimizer, result)
        # --eval-every N: mid-epoch too; its time left out of the speed and the phases
        if args.eval_every and step % args.eval_every == 0 and not last:
            with meter.paused():
                validate(run, epoch, step)
            run.model.train()
        # this point of the epoch: the same command continues from here (after a signal, when
        # --save-minutes' timer fired on some rank, then timing again, every --save-every steps)
        if (
            signum
            or run.stop.save_timer_fired()
            or (args.save_every and step % args.save_every == 0)
        ):
            with meter.paused():
                save_checkpoint(run, epoch, step)
        if signum:
            with utils.errors_shared_by_all_ranks():
                run.saves.wait()  # the stop's checkpoint whole before the process ends
            raise utils.Stopped(signum, epoch, step, recorder.steps_per_epoch)
    # all-reduce, every rank: the epoch's loss and accuracy over all ranks, its time and speed
    return meter.epoch_record()


def validate(run: Training, epoch: int, step: int) -> dict:
    """The validation at this step (--ema: the average's too), recorded; --keep-best: its weights
    in model_best.pt where they are the best so far. Every rank calls it."""
    validation = evaluate(run) if run.ema is None else run.ema.evaluated(evaluate, run)
    if run.recorder.new_best(validation):
        save_best(run)
    run.recorder.add(epoch, step, validation)
    return validation


@torch.no_grad()
def evaluate(run: Training) -> dict:
    """Loss (and accuracy) over the whole validation set, each sample counted once. Every rank
    calls it."""
    # evaluation mode, and rank 0's batch-norm statistics, the checkpoint's, on every rank
    for buffer in run.model.eval().buffers():
        dist.broadcast(buffer, 0)
    meter = metrics.Meter(run.device, top5=True)
    # every forward all-gathers weights from every rank, but shares may differ by a batch (a
    # stream's by more): while any rank has a batch, one whose share has ended joins with a spare
    # batch that counts for nothing
    spare = (0, run.val_loader.collate_fn(utils.first_samples(run.val_loader, 1))[1])
    # a batch this rank cannot read (a bad file) ends its share, and validation_record() every rank
    shard = meter.read(run.val_loader)
    while True:
        item = next(shard, None)
        # the ranks that have a batch
        if not utils.all_reduce(torch.tensor(int(item is not None), device=run.device)):
            break
        num_samples, batch = item or spare
        run.watchdog.batch()  # progress: a validation batch
        inputs, targets = utils.batch_to_device(
            batch, run.device, run.val_loader.dataset, run.args.channels_last
        )
        loss, outputs = eval_step(run, run.model, inputs, targets)
        if num_samples:
            meter.update(loss, outputs, targets, num_samples)
            if run.val_metrics is not None:
                run.val_metrics.update(outputs, targets)
    # the root keeps its weights gathered after forward, for a backward: free them
    utils.unwrap(run.model).reshard()
    # this rank's loss, hits and samples, one tensor; every rank: the sums over all ranks
    sums = meter.local_sums()
    dist.all_reduce(sums)
    # val_loss, val_acc (val_acc5 from 5 classes)
    record = meter.validation_record(sums)
    # all-gathers, every rank: your metrics over all ranks' samples
    if run.val_metrics is not None:
        record.update(run.val_metrics.compute())
    return record


def save_sharded(state: dict, directory: Path, watchdog, group: dist.ProcessGroup) -> None:
    """Every rank writes its shards into a new directory at once (collectives over group); rank 0
    then puts it in place of the last one, so that a kill mid-write leaves the last whole
    (load_sharded falls back to it). Run by every rank's writing thread (checkpoints.Saves)."""
    new, old = (
        directory.with_name(directory.name + ".new"),
        directory.with_name(directory.name + ".old"),
    )
    try:
        with watchdog.writing(directory, new):  # progress while the shard files grow
            dcp.save(state, checkpoint_id=new, process_group=group)
    except dcp.api.CheckpointException as e:  # a failed write on any rank, raised on every rank
        # a failed write() names no file: name the directory
        error = checkpoints.first_failure(e)
        if isinstance(error, OSError) and error.errno:
            raise OSError(error.errno, error.strerror, str(new)) from None
        raise checkpoints.write_error(new) from None
    if dist.get_rank() == 0:
        shutil.rmtree(old, ignore_errors=True)
        if directory.exists():
            os.replace(directory, old)
        os.replace(new, directory)
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(directory: Path, rank: int) -> str | None:
    """The last complete sharded checkpoint, as rank 0 sees it: checkpoint/, or checkpoint.old/
    after a kill between save_sharded's two renames; None if there is none."""
    old = directory.with_name(directory.name + ".old")
    found = (str(d) for d in (directory, old) if rank == 0 and (d / ".metadata").exists())
    return utils.all_gather_objects(next(found, None))[0]  # rank 0's


def load_sharded(
    path: str, state: dict, model: nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """Fill state (and the model and optimizer) from a checkpoint written by any number of
    processes."""
    # every rank reads the same files, so all fail alike: a broken .metadata, a missing key, another
    # model
    try:
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        # none before the first optimizer step
        if any(key.startswith("optimizer.state.") for key in saved):
            # what to load into: this rank's shards
            state["optimizer"] = get_optimizer_state_dict(model, optimizer)
        dcp.load(state, checkpoint_id=path)
    except (Exception, dcp.api.CheckpointException) as e:  # many types; dcp's a BaseException
        raise UsageError(
            f"{path} is not readable or does not fit this model or these flags"
            f" ({utils.first_line(checkpoints.first_failure(e))}): use another --output-dir"
        ) from None
    # a tied parameter was saved once: its other names too
    set_model_state_dict(model, checkpoints.tied_once(state["model"], model))
    if "optimizer" in state:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def training_state(run: Training) -> dict:
    """What continues the run exactly: every rank its own shards of the model and the optimizer,
    the rest once. An optimizer without state (no step taken yet) saves none: asked for it, PyTorch
    would make one with a step of its own. Every rank calls it (an all-reduce of the records)."""
    module, optimizer = utils.unwrap(run.model), run.optimizer
    return {
        # a tied head once
        "model": checkpoints.without_ties(get_model_state_dict(module), module),
        **({"optimizer": get_optimizer_state_dict(module, optimizer)} if optimizer.state else {}),
        "scheduler": run.scheduler.state_dict(),
        "scaler": run.scaler.state_dict(),
        # all-reduce, every rank: the epoch's sums over all ranks
        "records": run.recorder.all_ranks_state_dict(),
        # --ema's average; none without it (dcp reads what is asked: a checkpoint's average unread)
        **({} if run.ema is None else {"ema": run.ema.state_dict()}),
        "arch": run.args.arch,
        "optimizer_name": run.args.optimizer,
        "epoch": 0,
        "step": 0,
        "seed": run.args.seed,
        "world_size": dist.get_world_size(),  # what continues says so
    }


def save_checkpoint(run: Training, epoch: int, step: int, final: bool = False) -> None:
    """Epochs done, and steps done in the next: every rank's shards, copied to host memory and
    written while training goes on (collectives in the writing thread). Final: the whole weights
    too, gathered on rank 0 (model.pt, hf/, model_ema.pt), as at a stop by a signal. A full disk,
    or weights that are no longer finite, end every rank."""
    args, module, watchdog = run.args, utils.unwrap(run.model), run.watchdog
    final = final or bool(run.stop.agreed()[0])  # SIGTERM or SIGUSR1 on a rank: the run stops
    rank, output_dir = dist.get_rank(), Path(args.output_dir)
    # agreed before the sharded save, a collective, begins: never NaN over the last good checkpoint
    with utils.errors_shared_by_all_ranks():
        utils.check_finite(run.model, epoch, step, None, args)  # each rank its own shards
    with utils.errors_shared_by_all_ranks():
        state = {**training_state(run), "epoch": epoch, "step": step}
        write = functools.partial(save_sharded, group=run.save_group)
        run.saves.save(state, output_dir / "checkpoint", watchdog, write)
        # before the whole weights are written: one write at a time, which the watchdog times
        if final:
            run.saves.wait()
    # --ema: the average's twin
    for name in ["model", "model_ema"][: 1 + (run.ema is not None)] if final else []:
        # for one process, inference or distributed.py, written while swapped in
        # (one process's gathered weights are the model's own tensors)
        with run.ema.swapped() if name == "model_ema" else nullcontext():
            weights = gather_weights(module)
            with utils.errors_shared_by_all_ranks():
                if rank == 0:  # and a Hugging Face model's hf/, from the same gathered weights
                    checkpoints.save_checkpoint(weights, output_dir / f"{name}.pt", watchdog)
                    if name == "model":
                        checkpoints.save_pretrained(module, output_dir / "hf", watchdog, weights)
        del weights  # before the twin's: one whole copy at a time


def gather_weights(module: nn.Module) -> dict:
    """The whole weights on rank 0's CPU with plain keys (the others: none), each shard all-gathered
    once: a tied head with its embeddings, its keys one tensor again. Every rank calls it."""
    whole = {}
    sharded = checkpoints.without_ties(get_model_state_dict(module), module)
    for key, value in sharded.items():
        if hasattr(value, "full_tensor"):  # all-gather, every rank: a parameter's shards
            value = value.full_tensor()
        if dist.get_rank() == 0:
            whole[key] = value.cpu()
    return checkpoints.tied_once(whole, module)


def save_best(run: Training) -> None:
    """model_best.pt: the weights just validated (the average's for an _ema name), gathered whole
    with plain keys. Every rank calls it (the gather); rank 0 writes, while training goes on."""
    with run.ema.swapped() if run.args.keep_best.endswith("_ema") else nullcontext():
        weights = gather_weights(utils.unwrap(run.model))
        # copied before the swap back (one process's gathered weights are the model's own)
        with utils.errors_shared_by_all_ranks():
            if dist.get_rank() == 0:
                run.saves.save(weights, Path(run.args.output_dir) / "model_best.pt", run.watchdog)


def main(teardown: ExitStack) -> None:
    args = parse_args()
    rank, local_rank, world_size, device = setup_distributed(args)
    utils.setup_logging(rank)
    # from here SIGTERM and SIGUSR1 finish the step, save and exit; every --save-minutes, a save
    stop = utils.StopSignal(args.save_minutes)
    output_dir = Path(args.output_dir)
    # before data and model: a bad path fails at once, on every rank
    with utils.errors_shared_by_all_ranks():
        if rank == 0:
            output_dir.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=output_dir).close()  # it takes a file
            # a killed write's
            shutil.rmtree(output_dir / "checkpoint.new", ignore_errors=True)
    # from here a stalled rank ends every rank, named (before training: once another waited for it);
    # it stops as main ends (extras/stalls.py; --no-watchdog leaves it out: then nobody watches)
    watchdog = utils.NoWatchdog()
    if not args.no_watchdog:
        from extras import stalls

        watchdog = teardown.enter_context(stalls.Watchdog(args.timeout, output_dir, rank))
    # --workers N: a stalled rank's report says what its DataLoader workers are doing
    if args.workers and not args.no_watchdog:
        from extras import workers

        watchdog.worker_stacks = workers.worker_stacks
    # on a terminal, rank 0's live line while anything runs: the step of steps and the time left, a
    # validation's batches, a save, the start (extras/live.py, from the watchdog's notes);
    # --no-live-line leaves it out
    live_line = None
    if rank == 0 and sys.stderr.isatty() and not args.no_live_line and not args.no_watchdog:
        from extras import live

        live_line = teardown.enter_context(live.LiveLine(watchdog, args.epochs))
    # every rank's shards written by a thread while training goes on, its collectives over a
    # group of their own (the CPU's): a failed write ends every rank at the next step; the run
    # ends once they are written
    saves = teardown.enter_context(checkpoints.Saves(stop))
    # each rank's part of every global batch: equal, or within one sample of the others'
    split = utils.split_batch(args.batch_size, world_size, f"{world_size} processes")
    batch_per_rank = utils.share(args.batch_size, rank, world_size)
    amp_dtype = getattr(torch, args.amp_dtype) if args.amp_dtype else None
    if args.replicate < 1 or world_size % args.replicate:
        raise UsageError(f"--replicate {args.replicate} does not divide the {world_size} processes")
    # the shards' mesh: world size / N ranks hold each replica (hybrid sharding: gathers stay within
    # a node)
    mesh = (
        init_device_mesh(
            device.type,
            (args.replicate, world_size // args.replicate),
            mesh_dim_names=("replicate", "shard"),
        )
        if args.replicate > 1
        else init_device_mesh(device.type, (world_size,))
    )
    log.info(
        f"world size {world_size}, backend {dist.get_backend()}, device {device}, batch"
        f" {args.batch_size} = {split}, {args.optimizer} peak lr"
        f" {args.lr:.4g}, weight decay {args.weight_decay:g}, compute in"
        f" {amp_dtype or torch.float32}, {args.replicate} x {world_size // args.replicate} shards"
        + (
            "; --cpu-offload: on CPU processes the state is in host memory already"
            if args.cpu_offload and device.type == "cpu"
            else ""
        )
    )

    # cuDNN times its kernels once an input shape and keeps the fastest (inputs of many shapes:
    # a timing at each new one; False leaves it out)
    torch.backends.cudnn.benchmark = True
    # rank 0's initial weights, and the same random streams on every rank
    torch.manual_seed(args.seed)
    datasets = build_datasets(args)
    # the start-up checks, one line where training would trip: what the plug points returned, a
    # step (extras/checks.py; --no-checks leaves them out)
    if not args.no_checks:
        from extras import checks

        checks.returned_datasets(datasets)
    train_set, val_set, num_classes = datasets
    train_loader, val_loader = build_loaders(
        train_set, val_set, batch_per_rank, args, rank, world_size, device
    )
    # full batches, cut at --steps-per-epoch (which a stream without __len__ needs)
    steps_per_epoch = utils.steps_per_epoch(train_loader, args)
    # your metrics (build_metrics; its {}: none), over every validation sample once
    # (extras/scores.py)
    val_metrics = build_metrics(args, num_classes) or None
    if val_metrics is not None:
        from extras import scores

        val_metrics = scores.UserMetrics(val_metrics, device)
    # rank 0 builds (or reads) the weights; the others, no memory
    model = build_once(args, num_classes, rank)
    # what build_model returned, before it is sharded; --keep-best must name a validation value
    if not args.no_checks:
        from extras import checks

        checks.returned_model(model)
        checks.check_keep_best(args, val_metrics, num_classes)
    # your frozen models (build_frozen), e.g. a teacher: outside FSDP, the optimizer and saved files
    frozen = build_frozen(args, num_classes)
    # where the shards will be (offloaded: host memory)
    place = torch.device("cpu") if args.cpu_offload else device
    # what build_frozen returned; what each rank will hold beside the memory free for it (less the
    # frozen models' on a GPU): one line from every rank where it cannot fit
    if not args.no_checks:
        from extras import checks

        checks.frozen_models(frozen)
        with utils.errors_shared_by_all_ranks():
            free = checkpoints.host_memory_available()
            checks.check_state_fits(model, world_size // args.replicate, args, place, free, frozen)
    # rank 0's weights, to send each rank its shards of them
    whole = model.state_dict() if rank == 0 else {}
    # each block moves to the device and keeps 1/world_size of its weights there: the whole model
    # never does
    model = shard_model(model, amp_dtype, mesh, args)
    model = (
        model.to_empty(device=place)
        if any(p.is_meta for p in model.parameters())
        else model.to(place)
    )
    set_model_state_dict(
        model, whole, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    for buffer in model.buffers():  # those no state dict holds too (rotary tables)
        dist.broadcast(buffer, 0)
    del whole
    for module in frozen.values():  # on the device, in eval mode, without gradients
        module.to(device).eval().requires_grad_(False)
    flops_per_sample, convolutions = None, 0.0  # without the checks: no TFLOP/s
    # one step's forward and backward, undone: one line for what training would trip on, and the
    # FLOPs of a sample
    if not args.no_checks:
        from extras import checks

        flops_per_sample, convolutions = checks.first_step_flops(
            model, train_loader, compute_loss, args, device, unused_ok=True
        )
    if args.compile:
        model = torch.compile(model, mode=args.compile_mode)
    optimizer = utils.build_optimizer(model, args)  # over this rank's shards only
    scheduler = utils.warmup_cosine(optimizer, args.epochs * steps_per_epoch, args.warmup)
    # float16: a loss scale, and a step skipped on every rank when any rank's shard overflowed
    scaler = ShardedGradScaler(
        device.type, init_scale=args.init_scale, enabled=amp_dtype == torch.float16
    )
    # each epoch's line: TFLOP/s (the start-up step counted the FLOPs); on a GPU (or with
    # --peak-tflops) its mfu, over the dense peak of its GPUs for this precision (extras/peaks.py)
    peak_tflops = None
    if flops_per_sample and (device.type == "cuda" or args.peak_tflops):
        from extras import peaks

        peak_tflops = peaks.peak_tflops(
            device, amp_dtype or torch.float32, args.peak_tflops, world_size, convolutions
        )
    # --ema: a moving average of this rank's shards, validated and saved beside them
    ema = None
    if args.ema is not None:
        from extras import averages

        ema = averages.EMA(model, args.ema)
    # steps.jsonl (and TensorBoard, W&B) on rank 0: the numbers of every rank, every --print-freq
    # steps
    recorder = metrics.StepRecords(output_dir, args, rank, steps_per_epoch, saves=saves)
    # --phases: each rank's time a step in data, forward + loss and backward (with their
    # all-gathers and reduce-scatters) and the optimizer, read at each record, which names a slower
    # rank; --profile A:B also writes a torch.profiler trace a rank of those steps
    # (extras/profiles.py)
    if args.phases or args.profile:
        from extras import profiles

        recorder.phases = profiles.StepPhases(device)
        recorder.phases.watch(model, optimizer)
        teardown.enter_context(
            profiles.StepProfiler(args.profile, recorder.phases, output_dir, rank)
        )
    if live_line is not None:  # what it shows of training and validation
        live_line.show(recorder, val_loader)
    run = Training(
        args=args,
        model=model,
        frozen=frozen,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        ema=ema,
        train_loader=train_loader,
        val_loader=val_loader,
        device=device,
        stop=stop,
        watchdog=watchdog,
        saves=saves,
        # the saves' collectives on the CPU: a group every rank makes here
        save_group=dist.new_group(backend="gloo"),
        recorder=recorder,
        val_metrics=val_metrics,
    )

    path = latest_checkpoint(output_dir / "checkpoint", rank)
    state = training_state(run) if path else None
    if path:
        with utils.errors_shared_by_all_ranks():
            # what checkpoints hold: the model without torch.compile's wrapper
            load_sharded(path, state, utils.unwrap(model), optimizer)
    # the shards are in place; the rest, and the same command continues from the checkpoint
    start_epoch, steps_done = checkpoints.restore(
        state, path, args, scheduler=scheduler, scaler=scaler, records=recorder, ema=ema
    )
    recorder.start(start_epoch, steps_done)  # the records up to the checkpoint kept (rank 0)
    # --tensorboard, --wandb: rank 0 also sends the records there (a continued run: the same
    # W&B run)
    with utils.errors_shared_by_all_ranks():
        if rank == 0 and (args.tensorboard or args.wandb):
            from extras import sinks

            recorder.sinks = sinks.started(args, recorder)
    # rank 0's picture of the run, curves.svg beside steps.jsonl, drawn again at each validation
    # (extras/curves.py)
    if rank == 0:
        from extras import curves

        recorder.sinks.append(curves.Curves(recorder.path))

    last_epoch = min(args.epochs, start_epoch + (args.stop_after or args.epochs))
    for epoch in range(start_epoch, last_epoch):
        # continued mid-epoch: the steps its first epoch had done
        record = train_one_epoch(run, epoch, steps_done if epoch == start_epoch else 0)
        # every rank, at the epoch's last step; --ema: the average's too
        validation = validate(run, epoch, steps_per_epoch)
        # the epoch's TFLOP/s, and its mfu where the GPUs' peak is known
        tflops = flops_per_sample * record["images_per_s"] / 1e12 if flops_per_sample else None
        record = dict(
            epoch=epoch + 1,
            **record,
            **validation,
            lr=optimizer.param_groups[0]["lr"],
            world_size=world_size,
            **metrics.memory_mb(model, optimizer, device),
            tflops=tflops,
            mfu=tflops / peak_tflops if tflops and peak_tflops else None,
        )
        # the epoch's line (metrics.jsonl and W&B, then printed) before its checkpoint: a crash
        # between them redoes the epoch; a diverged run's never (each rank checks its own shards)
        with utils.errors_shared_by_all_ranks():
            utils.check_finite(model, epoch + 1, 0, record, args)
            if rank == 0:
                recorder.epoch(record)
        save_checkpoint(run, epoch + 1, 0, final=epoch + 1 == last_epoch)
    with utils.errors_shared_by_all_ranks():
        saves.wait()  # the last checkpoint written whole
    dist.barrier()  # nobody leaves before rank 0 has written the last checkpoint
    dist.destroy_process_group()


if __name__ == "__main__":
    utils.run_main(main)
