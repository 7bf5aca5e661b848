"""DistributedDataParallel (DDP): one process per GPU, or per CPU process.

    torchrun --standalone --nproc_per_node=4 distributed.py --dataset cifar100
    # one process (CPU where there is no GPU), a quarter of a minute on 2 cores:
    python distributed.py --dataset fake --fake-size 1024 --image-size 16 --batch-size 64 --epochs 3

Each process trains a full copy of the model on its shard of every batch;
DDP averages the gradients over all processes during backward(), so every
copy takes the same optimizer step.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from contextlib import ExitStack, nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, default_collate

import utils
from extras import (
    checkpoints,
    metrics,
)
from utils import log

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
    eval mode and without gradients, outside DDP, the optimizer and every saved file."""
    return {}


def train_step(run: Training, inputs, targets) -> dict:
    """One optimizer step on this rank's part of the global batch: what the loop records of it (the
    loss, the outputs its accuracy is scored on, the gradients' norm where clipped). Rewrite it for
    a step of your own: a loss that reads the inputs, a frozen teacher (docs/your-project.md)."""
    model, optimizer = run.model, run.optimizer
    outputs = utils.forward(model, inputs)
    loss = compute_loss(outputs, targets)
    optimizer.zero_grad(set_to_none=True)
    # loss.backward(), the loss weighted by this rank's part of the batch: exact for a (sum, count)
    # loss and for parts of unequal size; DDP all-reduces the gradients meanwhile, bucket by bucket
    run.backward(loss)
    grad_norm = None
    if run.args.clip_grad:  # the norm before clipping (all ranks hold the same gradients)
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), run.args.clip_grad)
    optimizer.step()
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
    utils.add_ddp_flags(parser)  # --sync-bn, --find-unused-parameters, --comm-hook
    # the deprecated torch.distributed.launch passes one of these; LOCAL_RANK wins
    parser.add_argument(
        "--local-rank",
        "--local_rank",
        type=int,
        default=0,
        help="set by torch.distributed.launch; read from LOCAL_RANK otherwise",
    )
    return utils.check_args(parser.parse_args())


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
            device_id=device if backend == "nccl" else None,
        )
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


@dataclasses.dataclass
class Training:
    """What the loop works with, built once in main()."""

    args: argparse.Namespace
    model: nn.Module  # wrapped in DDP
    frozen: dict[str, nn.Module]  # build_frozen's, e.g. run.frozen["teacher"]: not trained
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    ema: object | None  # --ema: the weights' moving average (extras/averages.py), or None
    train_loader: DataLoader
    val_loader: DataLoader
    device: torch.device
    stop: utils.StopSignal  # the step every rank stops, or saves, after
    watchdog: object  # a stalled rank ends every rank, named (stalls.Watchdog; or NoWatchdog)
    recorder: metrics.StepRecords  # steps.jsonl and its sinks, all ranks' numbers
    val_metrics: object | None  # build_metrics' (extras/scores.py): every sample counted once
    saves: checkpoints.Saves  # rank 0's checkpoint files, written while training goes on
    samples: tuple[int, int] = (0, 0)  # the step's: this rank's, all ranks'
    weighted: tuple[int, int] | None = None  # the samples run.backward() last weighted by

    def backward(self, loss, **kwargs) -> None:
        """loss.backward(), compute_loss's mean weighted by this rank's part of the step's samples,
        its (sum, count) by all ranks' count: the gradient of the whole batch's mean, also where
        the ranks' parts differ in size. Keyword arguments go to .backward() (retain_graph=True)."""
        self.weighted = self.samples
        utils.loss_for_backward(loss, *self.samples).backward(**kwargs)


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
    batches = meter.timed(loader)
    for step, (samples, batch) in run.stop.steps(batches, steps_done, recorder.steps_per_epoch):
        run.watchdog.batch(epoch, step)  # progress: the watchdog times the steps
        recorder.phases.new_step()  # its first optimizer step counts it, once
        # dropout and other randomness in the model: this rank's own, from (seed, rank, epoch,
        # step), as one process draws its own for each sample
        utils.seed_step(args.seed, epoch, step)
        # this rank's samples and all ranks' (--batch-size, or your sampler's): run.backward()
        # weights the loss by them
        step_samples = utils.samples_in_step(run.train_loader.sampler, step, args.batch_size)
        run.samples = (samples, step_samples)
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
        if run.ema is not None:  # --ema: the average moves toward the new weights
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
        # --save-minutes' timer fired on some rank, every --save-every steps)
        timer = run.stop.save_timer_fired()  # and it starts again
        if signum or timer or (args.save_every and step % args.save_every == 0):
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
    # not DDP's forward (a stream's shards may differ in length by a batch), in evaluation mode
    module = utils.unwrap(run.model).eval()
    # rank 0's batch-norm statistics, the checkpoint's, on every rank
    for buffer in module.buffers():
        dist.broadcast(buffer, 0)
    meter = metrics.Meter(run.device, top5=True)
    # a batch this rank cannot read (a bad file) ends its loop, and validation_record() every rank
    for num_samples, batch in meter.read(run.val_loader):
        run.watchdog.batch()  # progress: a validation batch
        inputs, targets = utils.batch_to_device(
            batch, run.device, run.val_loader.dataset, run.args.channels_last
        )
        loss, outputs = eval_step(run, module, inputs, targets)
        meter.update(loss, outputs, targets, num_samples)
        if run.val_metrics is not None:
            run.val_metrics.update(outputs, targets)
    # this rank's loss, hits and samples, one tensor; every rank: the sums over all ranks
    sums = meter.local_sums()
    dist.all_reduce(sums)
    # val_loss, val_acc (val_acc5 from 5 classes)
    record = meter.validation_record(sums)
    # all-gathers, every rank: your metrics over all ranks' samples
    if run.val_metrics is not None:
        record.update(run.val_metrics.compute())
    return record


def save_checkpoint(run: Training, epoch: int, step: int) -> None:
    """What continues the run exactly: epochs done, and steps done in the next. Every rank calls
    it; rank 0 copies the state and writes it while training goes on (the others hold the same
    weights). Weights that are no longer finite end every rank; a full disk at the next step."""
    # all-reduce, every rank: the epoch's sums over all ranks, which the next record and epoch need
    progress = run.recorder.all_ranks_state_dict()
    with utils.errors_shared_by_all_ranks():
        if dist.get_rank() == 0:
            # never NaN over the last good checkpoint
            utils.check_finite(run.model, epoch, step, None, run.args)
            checkpoint = {
                "model": utils.unwrap(run.model).state_dict(),
                "optimizer": run.optimizer.state_dict(),
                "scheduler": run.scheduler.state_dict(),
                "ema": None if run.ema is None else run.ema.state_dict(),
                "records": progress,
                "epoch": epoch,
                "step": step,
                "arch": run.args.arch,
                "optimizer_name": run.args.optimizer,
                "seed": run.args.seed,
                "world_size": dist.get_world_size(),  # what continues says so
            }
            run.saves.save(checkpoint, Path(run.args.output_dir) / "checkpoint.pt", run.watchdog)
            if run.ema is not None:  # and the average alone, with plain keys
                with run.ema.swapped():
                    state = utils.unwrap(run.model).state_dict()
                    run.saves.save(state, Path(run.args.output_dir) / "model_ema.pt", run.watchdog)


def save_best(run: Training) -> None:
    """model_best.pt: the weights just validated (the average's for an _ema name), plain keys.
    Every rank calls it; rank 0 writes, while training goes on."""
    with utils.errors_shared_by_all_ranks():
        if dist.get_rank() == 0:
            with run.ema.swapped() if run.args.keep_best.endswith("_ema") else nullcontext():
                state = utils.unwrap(run.model).state_dict()
                run.saves.save(state, Path(run.args.output_dir) / "model_best.pt", run.watchdog)


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
    # rank 0's checkpoints written by a thread while training goes on: a failed write ends
    # every rank at the next step; the run ends once they are written
    saves = teardown.enter_context(checkpoints.Saves(stop))
    # each rank's part of every global batch: equal, or within one sample of the others'
    split = utils.split_batch(args.batch_size, world_size, f"{world_size} processes")
    batch_per_rank = utils.share(args.batch_size, rank, world_size)
    log.info(
        f"world size {world_size}, backend {dist.get_backend()}, device {device}, batch"
        f" {args.batch_size} = {split}, {args.optimizer} peak lr"
        f" {args.lr:.4g}, weight decay {args.weight_decay:g}"
    )

    # cuDNN times its kernels once an input shape and keeps the fastest (inputs of many shapes:
    # a timing at each new one; False leaves it out)
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(args.seed)  # every rank's random streams alike (DDP sends rank 0's weights)
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
    model = build_model(args, num_classes)
    # what build_model returned, before it moves; --keep-best must name a validation value
    if not args.no_checks:
        from extras import checks

        checks.returned_model(model, together=True)
        checks.check_keep_best(args, val_metrics, num_classes)
    # --channels-last: NHWC, what Tensor Core convolutions read
    model = model.to(device, memory_format=utils.memory_format(args))
    # your frozen models (build_frozen), e.g. a teacher: outside DDP, the optimizer and saved files
    frozen = build_frozen(args, num_classes)
    flops_per_sample, convolutions = None, 0.0  # without the checks: no TFLOP/s
    # what build_frozen returned, before they move; one step's forward and backward, undone: one
    # line for what training would trip on, and the FLOPs of a sample
    if not args.no_checks:
        from extras import checks

        checks.frozen_models(frozen)
        flops_per_sample, convolutions = checks.first_step_flops(
            model, train_loader, compute_loss, args, device, unused_ok=args.find_unused_parameters
        )
    for module in frozen.values():  # on the device, in eval mode, without gradients
        module.to(device).eval().requires_grad_(False)
    # --sync-bn: batch-norm statistics of the global batch, not of each rank's part
    # (PyTorch's SyncBatchNorm has no CPU kernel: on CPU processes the same statistics over gloo)
    if args.sync_bn and device.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    elif args.sync_bn:
        from extras import batch_norm

        model = batch_norm.convert_to_global(model)
    # gradients live in DDP's communication buckets: no copy in or out each step;
    # batch-norm statistics go out at evaluation, not before every forward
    options = dict(
        device_ids=[local_rank] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
        find_unused_parameters=args.find_unused_parameters,
        # forward_sync_buffers=False (broadcast_buffers=False before PyTorch 2.14)
        **utils.no_buffer_sync_per_forward(),
    )
    # models trained together (a GAN's, extras/together.py): each its own DDP, optimizer, schedule
    if getattr(model, "trained_together", False):
        from extras import together

        model = together.Wrapped(model, DDP, **options)
    else:
        model = DDP(model, **options)
    # --comm-hook bf16: the gradients cross the network as bfloat16, half the bytes
    if args.comm_hook:
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    # --compile: DDP's buckets split the compiled graph (models trained together: each one's)
    if args.compile and getattr(model, "trained_together", False):
        model = model.compiled(mode=args.compile_mode)
    elif args.compile:
        model = torch.compile(model, mode=args.compile_mode)
    # --optimizer: SGD or AdamW (models trained together: one each, run.optimizer["generator"])
    optimizer = utils.build_optimizer(model, args)
    scheduler = utils.warmup_cosine(optimizer, args.epochs * steps_per_epoch, args.warmup)

    # each epoch's line: TFLOP/s (the start-up step counted the FLOPs); on a GPU (or with
    # --peak-tflops) its mfu, over the dense peak of its GPUs for this precision (extras/peaks.py)
    peak_tflops = None
    if flops_per_sample and (device.type == "cuda" or args.peak_tflops):
        from extras import peaks

        peak_tflops = peaks.peak_tflops(
            device, torch.float32, args.peak_tflops, world_size, convolutions
        )
    # --ema: a moving average of the weights, validated and saved beside them
    ema = None
    if args.ema is not None:
        from extras import averages

        ema = averages.EMA(model, args.ema)
    # steps.jsonl (and TensorBoard, W&B) on rank 0: the numbers of every rank, every --print-freq
    # steps
    recorder = metrics.StepRecords(output_dir, args, rank, steps_per_epoch, saves=saves)
    # --phases: each rank's time a step in data, forward + loss, backward, the wait for the other
    # ranks and the optimizer, read at each record, which names a slower rank; --profile A:B also
    # writes a torch.profiler trace a rank of those steps (extras/profiles.py)
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
        ema=ema,
        train_loader=train_loader,
        val_loader=val_loader,
        device=device,
        stop=stop,
        watchdog=watchdog,
        recorder=recorder,
        val_metrics=val_metrics,
        saves=saves,
    )

    checkpoint_path = output_dir / "checkpoint.pt"
    # the same command continues from the checkpoint, and says so: rank 0 reads it, every rank
    # receives it
    start_epoch, steps_done = checkpoints.restore(
        checkpoints.load_checkpoint_everywhere(checkpoint_path, rank),
        checkpoint_path,
        args,
        model=utils.unwrap(model),
        optimizer=optimizer,
        scheduler=scheduler,
        records=recorder,
        ema=ema,
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
        # between them redoes the epoch; a diverged run's never
        with utils.errors_shared_by_all_ranks():
            if rank == 0:
                utils.check_finite(model, epoch + 1, 0, record, args)
                recorder.epoch(record)
        save_checkpoint(run, epoch + 1, 0)
    # a Hugging Face model: hf/, for from_pretrained (a PEFT adapter alone)
    with utils.errors_shared_by_all_ranks():
        if rank == 0:
            saves.wait()  # the last checkpoint written whole
            checkpoints.save_pretrained(utils.unwrap(model), output_dir / "hf", watchdog)
    dist.barrier()  # nobody leaves before rank 0 has written the last checkpoint
    dist.destroy_process_group()


if __name__ == "__main__":
    utils.run_main(main)
