"""What a run measures: an epoch's sums on each rank (Meter), added over all ranks, and the records
of steps.jsonl, its console lines and its sinks (StepRecords). The throughput key `images_per_s`
counts samples, whatever a sample is (an image, a token sequence).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import datetime
import json
import logging
import math
import re
import resource
import time
import uuid
from pathlib import Path

import torch
import torch.nn as nn

from utils import (
    UsageError,
    all_gather_objects,
    all_reduce,
    append_metrics,
    check_finite,
    class_indices,
    count_to_device,
    describe_value,
    errors_shared_by_all_ranks,
    local_shard,
    logits,
    rank,
    world_size,
    write_atomically,
)

log = logging.getLogger("train")


@dataclasses.dataclass
class Sums:
    """Sums over batches, in the order of the float64 tensor they travel in (one all-reduce)."""

    loss: float  # of the loss over its items
    items: float  # what the loss is a mean over: samples, or a (sum, count) loss's count
    correct: float  # class targets scored right
    scored: float  # class targets scored
    correct5: float  # class targets among the top 5 scores (validation, 5 classes or more)
    scored5: float  # class targets scored so, out of 5 classes or more
    samples: float

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Sums:
        return cls(*tensor.tolist())

    def mean_loss(self) -> float:
        return self.loss / max(self.items, 1)

    def accuracy(self) -> float | None:
        """None where no target was a class index."""
        if not self.scored:
            return None
        return self.correct / self.scored

    def top5_accuracy(self) -> float | None:
        """None where no target was a class index of 5 classes or more (or top 5 was not
        counted)."""
        if not self.scored5:
            return None
        return self.correct5 / self.scored5

    def validation_record(self) -> dict:
        """val_loss, val_acc (None where no target was a class index), val_images; val_acc5 from 5
        classes."""
        record = dict(
            val_loss=self.mean_loss(), val_acc=self.accuracy(), val_images=int(self.samples)
        )
        if self.scored5:
            record["val_acc5"] = self.top5_accuracy()
        return record


SUMS = len(dataclasses.fields(Sums))
# Steps kept before they are added up: at most 32 (a batch from a loader's worker holds a file
# descriptor) and 2**20 target elements (8 MB of int64; a segmentation's larger batch at once).
KEPT_STEPS, KEPT_ELEMENTS = 32, 2**20


def zero_sums(device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.zeros(SUMS, dtype=torch.float64, device=device)


class Meter:
    """An epoch's Sums on this rank, its time, and how long this rank waited for its data."""

    def __init__(
        self,
        device: torch.device,
        saved: dict | None = None,
        rank: int = 0,
        phases=None,
        top5: bool = False,
    ):
        # Continued mid-epoch, rank 0 holds what all ranks had summed at the checkpoint, and what
        # the last record had read, so the records go on as before.
        self.before = zero_sums()
        self.recorded = zero_sums()
        if saved is not None:
            self.before = saved["sums"]
            self.recorded = saved["recorded"]
        self.sums = zero_sums(device)
        if rank == 0:
            self.sums += self.before.to(device)
        # Counts that are Python numbers (samples, a loss's item count) add up on the host: made
        # into a device tensor each step, they would wait for the GPU.
        self.items = self.samples = 0
        # Each step's loss sum, (sum, count) count, and (argmax, targets) since the last record,
        # with the targets' elements and classes.
        self.totals, self.counts, self.guesses, self.kept = [], [], [], 0
        self.hits5 = []
        self.classes = 0
        self.start = time.perf_counter()
        # The line of a batch read() could not read.
        self.error = ""
        self.data_wait = 0.0
        self.data_wait_recorded = 0.0
        # Whether the loss is a (sum, count) pair, whose items/s the records show too.
        self.pairs = False
        # When, and at which sums, the last record read the speed.
        self.marked_at = self.start
        self.marked_sums = self.before
        # Seconds not spent training (paused: a mid-epoch validation, a save), and at that record.
        self.aside = self.aside_marked = 0.0
        # Each step's phases on this rank (profiles.StepPhases: training's), or none timed.
        self.phases = phases or NoPhases()
        # Whether the targets among the top 5 scores are counted too (a validation's).
        self.top5 = top5
        # The steps' other losses (a GAN's generator loss), each its sum over the samples since
        # the last record and those samples; continued mid-epoch, rank 0 holds all ranks' saved.
        self.others = {}
        if saved is not None and rank == 0:
            self.others = {name: t.to(device) for name, t in saved.get("others", {}).items()}

    def update(self, loss, outputs, targets, samples: int) -> None:
        """Add a batch: its loss (a mean, or a (sum, count) pair), and its accuracy where the
        targets are class indices. Each step's tensors are kept as they are, and added up at a
        record (add_kept): a few small ops a step, not a dozen."""
        scores = logits(outputs)
        guessed = class_indices(scores, targets) and scores.shape[1] > 1
        # Where the classes change, the steps kept so far are added up, scored against their own.
        if guessed and scores.shape[1] != self.classes:
            self.add_kept()
            self.classes = scores.shape[1]
        self.pairs = not isinstance(loss, torch.Tensor)
        if self.pairs:
            total, items = loss
            total = total.detach()
        else:
            total, items = loss.detach() * samples, samples
        if isinstance(items, torch.Tensor):
            self.counts.append(count_to_device(items, self.sums.device))
        else:
            self.items += items
        self.totals.append(total)
        self.samples += samples
        if guessed:
            self.guesses.append((scores.argmax(1), targets))
            self.kept += targets.numel()
            # Validation, 5 classes or more: is the target among the top 5 scores?
            if self.top5 and scores.shape[1] >= 5:
                self.hits5.append((scores.topk(5, dim=1).indices == targets.unsqueeze(1)).any(1))
        if len(self.totals) == KEPT_STEPS or self.kept > KEPT_ELEMENTS:
            self.add_kept()

    def add_step(self, result, samples: int, targets, recorded: bool = False) -> None:
        """A training step's: train_step's dict, its loss and outputs added (recorded: the step
        added its micro-batches' itself), and its other numbers (add_others)."""
        if not isinstance(result, dict) or (
            not recorded and not {"loss", "outputs"} <= result.keys()
        ):
            raise UsageError(
                "train_step must return a dict of the step's loss and outputs (and its grad_norm or"
                f" None), not {describe_value(result)}"
            )
        if not recorded:
            self.update(result["loss"], result["outputs"], targets, samples)
        self.add_others(result, samples)

    def add_others(self, result: dict, samples: int) -> None:
        """A step's other losses (train_step's other keys, numbers), weighted by its samples: kept
        on the device, nothing read back."""
        for name, value in result.items():
            if name in ("loss", "outputs", "grad_norm"):
                continue
            value = torch.as_tensor(value, device=self.sums.device).detach().double()
            if value.numel() != 1:
                raise UsageError(
                    f"train_step's {name!r} is recorded as train_{name}: return a number (a scalar"
                    f" tensor), not {describe_value(value)}"
                )
            pair = torch.stack([value.reshape(()) * samples, value.new_tensor(samples)])
            self.others[name] = self.others.get(name, 0) + pair

    def all_ranks_others(self) -> dict[str, torch.Tensor]:
        """Every rank calls it (an all-reduce where the steps return other losses): each one's sum
        over all ranks' samples since the last record, and those samples, on the CPU."""
        names = sorted(self.others)
        if not names:
            return {}
        sums = all_reduce(torch.stack([self.others[name] for name in names])).cpu()
        return dict(zip(names, sums))

    def others_since_record(self) -> dict:
        """Every rank calls it: the other losses' means over all ranks since the last record, as
        train_<name>."""
        sums = self.all_ranks_others()
        self.others = {}
        return {
            f"train_{name}": (total / samples).item() for name, (total, samples) in sums.items()
        }

    def add_kept(self) -> None:
        """The kept steps' losses, counts and guesses added to the sums, where they are: nothing
        read back, no wait. An argmax is a class: a label that is none (a segmentation's "ignore")
        is never counted right, nor scored."""
        if not self.totals:
            return
        zero = correct = scored = correct5 = scored5 = counted = self.sums.new_zeros(())
        if self.guesses:
            guesses = torch.cat([guess.flatten() for guess, _ in self.guesses])
            targets = torch.cat([target.flatten() for _, target in self.guesses])
            correct = (guesses == targets).sum()
            scored = ((targets >= 0) & (targets < self.classes)).sum()
        # Counted, the top 5 is every kept step's (all of the same classes).
        if self.hits5:
            correct5 = torch.cat([hit.flatten() for hit in self.hits5]).sum()
            scored5 = scored
        if self.counts:
            counted = torch.stack(self.counts).sum()
        total = torch.stack(self.totals).sum(dtype=torch.float64)
        # stack promotes to the sums' float64
        self.sums += torch.stack([total, counted, correct, scored, correct5, scored5, zero])
        self.totals, self.counts, self.guesses, self.kept = [], [], [], 0
        self.hits5 = []

    def all_sums(self) -> torch.Tensor:
        """This rank's sums with its host counts, on the device (copied from the host: only where a
        record is made)."""
        self.add_kept()
        return self.sums + self.sums.new_tensor([0, self.items, 0, 0, 0, 0, self.samples])

    def read(self, loader):
        """The loader's batches, up to one this rank cannot read (a bad file: a UsageError), whose
        line all_ranks() then ends every rank with."""
        try:
            yield from loader
        except UsageError as e:
            self.error = str(e)

    def local_sums(self, row: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's sums and its row of a table of all ranks' (whether it could not read a
        batch, then row): one tensor, which an all-reduce makes all ranks'."""
        if row is None:
            row = torch.zeros(0, dtype=torch.float64)
        table = torch.zeros(world_size(), 1 + len(row), dtype=torch.float64)
        # Each rank its own row: the sum holds every rank's exactly.
        table[rank(), 0] = float(bool(self.error))
        table[rank(), 1:] = row
        return torch.cat([self.all_sums(), table.flatten().to(self.sums.device)])

    def reduced(self, both: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All ranks' local_sums(), summed: the sums and the table of rows, both on the CPU; where a
        rank could not read a batch, every rank ends with its line."""
        # Read back to the host (a sync with the GPU): at a record, a save and an epoch's end only.
        both = both.cpu()
        table = both[SUMS:].view(world_size(), -1)
        if table[:, 0].any():
            raise UsageError(next(e for e in all_gather_objects(self.error) if e))
        # The sums in a tensor of their own, which a checkpoint keeps as it is.
        return both[:SUMS].clone(), table[:, 1:]

    def all_ranks_sums(self, row: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank calls it at the same step (one all-reduce): reduced()'s sums and table, this
        rank's row in it row."""
        return self.reduced(all_reduce(self.local_sums(row)))

    def all_ranks(self) -> Sums:
        """Every rank calls it (an all-reduce): the sums over all ranks."""
        return Sums.of(self.all_ranks_sums()[0])

    def validation_record(self, both: torch.Tensor) -> dict:
        """All ranks' local_sums(), summed, as Sums.validation_record: val_loss, val_acc (val_acc5),
        val_images."""
        return Sums.of(self.reduced(both)[0]).validation_record()

    def since_record(self) -> dict:
        """Every rank calls it (an all-reduce): loss, accuracy and speed since the last record
        (items/s of a (sum, count) loss too), the longest wait of a rank for its data and that
        rank, and each rank's phases, ms a step, with the slow rank."""
        row = torch.cat(
            [torch.tensor([self.data_wait - self.data_wait_recorded]), self.phases.read()]
        )
        # One collective for all, read back to the host (a sync with the GPU: a recording step's
        # only one, with the gradients' norm and the phases' events).
        now, table = self.all_ranks_sums(row)
        waits = table[:, 0]
        seconds = time.perf_counter() - self.marked_at - (self.aside - self.aside_marked)
        since = Sums.of(now - self.recorded)
        moved = Sums.of(now - self.marked_sums)
        self.recorded = now
        self.marked_at = time.perf_counter()
        self.marked_sums = now
        self.aside_marked = self.aside
        self.data_wait_recorded = self.data_wait
        record = dict(
            train_loss=since.mean_loss(),
            train_acc=since.accuracy(),
            images_per_s=moved.samples / seconds,
        )
        if self.pairs:
            record["items_per_s"] = moved.items / seconds
        record["data_wait_max_s"] = waits.max().item()
        record["data_wait_rank"] = int(waits.argmax())
        return dict(**record, **self.phases.summary(table[:, 1:]))

    def epoch_record(self) -> dict:
        """Every rank calls it (an all-reduce): the epoch's loss and accuracy over all ranks, its
        time, this run's speed, and each rank's phases with the slow rank."""
        self.phases.pause()
        sums, table = self.all_ranks_sums(self.phases.epoch_read())
        totals = Sums.of(sums)
        seconds = time.perf_counter() - self.start
        samples = totals.samples - Sums.of(self.before).samples
        return dict(
            train_loss=totals.mean_loss(),
            train_acc=totals.accuracy(),
            epoch_time_s=seconds,
            images_per_s=samples / (seconds - self.aside),
            data_wait_s=self.data_wait,
            **self.phases.summary(table),
        )

    @contextlib.contextmanager
    def paused(self):
        """A block of the epoch that is not training (a mid-epoch validation, a save): its time is
        left out of the speed (images/s, TFLOP/s, the time left) and of the phases."""
        self.phases.pause()
        began = time.perf_counter()
        try:
            yield
        finally:
            self.aside += time.perf_counter() - began
            self.phases.begin()

    def timed(self, iterable):
        """Yield from iterable, adding the time each item took to arrive to data_wait; the
        phases' data."""
        self.phases.begin()
        asked = time.perf_counter()
        for item in iterable:
            self.data_wait += time.perf_counter() - asked
            self.phases.batch_arrived()
            yield item
            self.phases.batch_asked()
            asked = time.perf_counter()


class NoPhases:
    """A step's phases where none are timed (--phases: profiles.StepPhases'): none to record."""

    def begin(self) -> None:
        pass

    pause = batch_arrived = batch_asked = new_step = begin

    def enter(self, phase: str) -> None:
        pass

    def read(self) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.float64)

    epoch_read = read

    def summary(self, table: torch.Tensor) -> dict:
        return {}


class StepRecords:
    """steps.jsonl by rank 0, and its sinks (TensorBoard, W&B): all ranks' numbers every few
    steps; a continued run's records go on as if it had never stopped. Every rank builds it (its
    W&B run id is gathered from all)."""

    def __init__(self, output_dir: Path, args, rank: int, steps_per_epoch: int, saves=None):
        self.path = output_dir / "steps.jsonl"
        # each step's phases (--phases: profiles.StepPhases, set by the script), or none timed
        self.phases = NoPhases()
        # checkpoints.Saves: a record that finds the disk full waits for the checkpoint written
        self.saves = saves
        self.args = args
        self.rank = rank
        self.steps_per_epoch = steps_per_epoch
        # What a checkpoint holds (its shape: a sharded checkpoint loads into it); a W&B run id
        # alike on every rank.
        self.saved = {
            "sums": zero_sums(),
            "recorded": zero_sums(),
            "wandb_id": all_gather_objects(uuid.uuid4().hex[:12])[0],
            # --keep-best: the best value so far (NaN: none yet)
            "best": torch.tensor(math.nan, dtype=torch.float64),
        }
        self.meter = None
        self.sinks = []
        self.last_values = {}  # the last record's (a terminal's live line shows them)

    def meter_for_epoch(self, device: torch.device, first_step: int) -> Meter:
        saved = None
        if first_step:
            saved = self.saved
        self.meter = Meter(device, saved, self.rank, self.phases)
        return self.meter

    def all_ranks_state_dict(self) -> dict:
        """Every rank calls it (an all-reduce): the epoch's sums over all ranks, for a
        checkpoint."""
        state = dict(self.saved)
        if self.meter is not None:
            state["sums"] = self.meter.all_ranks_sums()[0]
            state["recorded"] = self.meter.recorded
            state["others"] = self.meter.all_ranks_others()
        return state

    def load_state_dict(self, state: dict) -> None:
        # A checkpoint written before --keep-best was kept holds no best.
        self.saved = {"best": self.saved["best"], **state}

    def new_best(self, validation: dict) -> bool:
        """--keep-best NAME: does this validation's NAME beat the best so far? Then it is kept (in
        the checkpoint) and the record says so. Every rank calls it with the same values, so all
        agree."""
        name = self.args.keep_best
        if not name:
            return False
        value = validation.get(name)
        if not isinstance(value, (int, float)):
            names = ", ".join(key for key, v in validation.items() if isinstance(v, (int, float)))
            raise UsageError(
                f"--keep-best {name}: the validation has {'null' if name in validation else 'no'}"
                f" {name}; it has {names}"
            )
        # a value that is no number (an AUROC of one class) is never the best
        if math.isnan(value):
            return False
        best = self.saved["best"].item()
        if not math.isnan(best):
            better = value < best
            if self.args.keep_best_mode == "max":
                better = value > best
            if not better:
                return False
        self.saved["best"].fill_(value)
        validation["new_best"] = name
        return True

    def start(self, epoch: int, step: int) -> None:
        """Every rank calls it; on rank 0: keep the records up to the checkpoint's epochs and steps
        done (the records after them are written again), and start the sinks; W&B gets every kept
        record again."""
        with errors_shared_by_all_ranks():
            if self.rank == 0:
                self.start_on_rank_0(epoch, step)

    def start_on_rank_0(self, epoch: int, step: int) -> None:
        last = {"epoch": epoch, "global_step": epoch * self.steps_per_epoch + step}
        kept = {}
        for path, key in (
            (self.path.with_name("metrics.jsonl"), "epoch"),
            (self.path, "global_step"),
        ):
            lines = []
            if path.exists():
                lines = [line for line in path.read_text().splitlines() if line]
            records = [json.loads(line) for line in lines]
            kept[key] = [record for record in records if record[key] <= last[key]]
            kept_lines = [line for line, record in zip(lines, records) if record[key] <= last[key]]
            if kept_lines != lines:
                # Written anew whole: a full disk loses none.
                text = "".join(line + "\n" for line in kept_lines)
                write_atomically(path, text.encode())
        # what a sink replays (sinks.started)
        self.last, self.kept = last, kept

    def train(
        self, epoch: int, step: int, model: nn.Module, optimizer, result: dict, **more
    ) -> None:
        """Every rank calls it at the same step (all-reduces): a training record of all ranks'
        numbers since the last one (Meter.since_record's), the learning rate, the gradients' norm
        (train_step's, or measured as the step left them), the step's other numbers as
        train_<name>, and more; a diverged run stops here."""
        since_record = self.meter.since_record()
        grad_norm = result.get("grad_norm")
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if grad_norm is None and grads:  # not clipped: measured, the gradients left as they are
            grad_norm = nn.utils.get_total_norm(grads)
        if hasattr(grad_norm, "full_tensor"):  # FSDP's: all shards' (a collective)
            grad_norm = grad_norm.full_tensor()
        record = dict(
            **since_record,
            lr=optimizer.param_groups[0]["lr"],
            grad_norm=None if grad_norm is None else float(grad_norm),
            peak_mem_mb=peak_memory_mb(self.meter.sums.device),
            # the step's other numbers (a GAN's generator loss), over all ranks: an all-reduce
            **self.meter.others_since_record(),
            **more,
        )
        check_finite(None, epoch, step, record, self.args)
        # The run's time left at this speed: the rest of this epoch and the epochs after it.
        left = (
            self.args.batch_size
            / record["images_per_s"]
            * ((self.args.epochs - epoch) * self.steps_per_epoch - step)
        )
        self.add(epoch, step, record, f" left {datetime.timedelta(seconds=int(left))}")

    def add(self, epoch: int, step: int, values: dict, suffix: str = "") -> None:
        """Every rank calls it at the same step: a record of values at this step, and its console
        line; a failed write ends all ranks."""
        where = f"epoch {epoch + 1}/{self.args.epochs} step {step}/{self.steps_per_epoch}"
        log.info(f"{where} {format_record(values)}{suffix}{best_line(values)}{slow_line(values)}")
        global_step = epoch * self.steps_per_epoch + step
        # the processes that took the step: an elastic run's change shows
        values = {**values, "world_size": world_size()}
        self.last_values = values
        # A full disk ends every rank with one line.
        with errors_shared_by_all_ranks():
            # One writer: the numbers are all ranks' already (the others log warnings only).
            if self.rank == 0:
                record = dict(epoch=epoch + 1, step=step, global_step=global_step, **values)
                self.append(self.path, record)
                for sink in self.sinks:
                    sink.log_step(values, global_step)

    def append(self, path: Path, record: dict) -> None:
        """record in path (steps.jsonl, metrics.jsonl), whole or not at all."""
        try:
            append_metrics(path, record)
        except OSError as e:
            # a checkpoint written meanwhile that filled the disk is the cause: its file named
            if e.errno == errno.ENOSPC and self.saves is not None:
                self.saves.wait()
            raise

    def epoch(self, record: dict) -> None:
        """On rank 0: the epoch's line in metrics.jsonl (whole or not at all), in the sinks at its
        last step, then printed."""
        self.append(self.path.with_name("metrics.jsonl"), record)
        for sink in self.sinks:
            sink.log_epoch(record, record["epoch"] * self.steps_per_epoch)
        first = ("train_loss", "train_acc", "val_loss", "val_acc", "val_acc_ema")
        shown = format_record(record, *first)
        # then the other validation values (not counts): top-5, build_metrics' (and the average's)
        others = [
            key
            for key, value in record.items()
            if key.startswith("val_") and key not in first and isinstance(value, float)
        ]
        more = ""
        if others:
            more = f" {format_record(record, *others)}"
        seconds = record["epoch_time_s"]
        speed = record["images_per_s"]
        where = f"epoch {record['epoch']}/{self.args.epochs}"
        log.info(
            f"{where} {shown} time {seconds:.1f}s {speed:.0f} img/s{more}{best_line(record)}"
            f"{slow_line(record)}"
        )


def format_record(record: dict, *keys: str) -> str:
    """'key value ...' of keys (all by default): losses and accuracies to 4 decimals, the rest to 4
    digits."""
    parts = []
    for key in keys or record:
        value = record.get(key)
        if not isinstance(value, (int, float)):  # phase_ms and slow: slow_line's
            continue
        if re.search("(loss|acc|acc5)(_ema)?$", key):
            parts.append(f"{key} {value:.4f}")
        else:
            parts.append(f"{key} {value:.4g}")
    return " ".join(parts)


def best_line(record: dict) -> str:
    """', the best val_loss so far: model_best.pt' where the record is --keep-best's new best."""
    if "new_best" not in record:
        return ""
    return f", the best {record['new_best']} so far: model_best.pt"


def peak_memory_mb(device: torch.device) -> float:
    """This rank's peak memory: on a GPU allocated, on the CPU resident (getrusage's KiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def megabytes(tensors) -> float:
    """What this rank holds of tensors (its shards of FSDP's), in MB."""
    total = 0
    for tensor in tensors:
        shard = local_shard(tensor)
        total += shard.numel() * shard.element_size()
    return total / 2**20


def memory_mb(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> dict:
    """MB: peak memory; parameters, gradients, optimizer state held by this rank."""
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return dict(
        peak_mem_mb=peak_memory_mb(device),
        params_mb=megabytes(params),
        grads_mb=megabytes(p for p in params if p.requires_grad),
        optimizer_mb=megabytes(state),
    )


def slow_line(record: dict) -> str:
    """The slow rank of a record in words, or nothing."""
    slow = record.get("slow")
    if not slow:
        return ""
    return (
        f"; rank {slow['rank']} slow: {slow['phase']} {slow['ms']:.1f} ms a step against a"
        f" median of {slow['median_ms']:.1f} ms"
    )
