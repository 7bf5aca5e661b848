"""Where rank 0 also sends steps.jsonl's records: TensorBoard (--tensorboard) and Weights & Biases
(--wandb), each imported only when its flag asks for it.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from utils import UsageError, first_line


class TensorBoardSink:
    """--tensorboard: each training and validation record's values at their global step in
    OUTPUT_DIR/tensorboard/; a continued run's events purge the steps after its checkpoint."""

    def __init__(self, directory: Path, first_step: int):
        # Imported only when asked for: torch.utils.tensorboard imports tensorboard.
        tensorboard = importlib.import_module("torch.utils.tensorboard")
        self.writer = tensorboard.SummaryWriter(directory, purge_step=first_step)

    def log_step(self, values: dict, global_step: int) -> None:
        for key, value in numbers(values).items():
            self.writer.add_scalar(key, value, global_step)
        # On disk before a later checkpoint: a kill loses no point the checkpoint keeps.
        self.writer.flush()

    def log_epoch(self, record: dict, global_step: int) -> None:
        """The epochs' lines stay in metrics.jsonl: their values are in the steps' records."""


class WandbSink:
    """--wandb: every record a row of a Weights & Biases run, plotted against its global_step (not
    W&B's own count); the epochs' lines at their last step, under epoch/. A continued run is the
    same run: its id is kept in the checkpoint."""

    def __init__(self, project: str, run_id: str, config: dict, directory: Path):
        wandb = importlib.import_module("wandb")
        try:
            self.run = wandb.init(
                project=project, id=run_id, resume="allow", config=config, dir=directory
            )
        except wandb.errors.Error as e:
            # Not logged in, no network: one line on every rank.
            message = f"--wandb cannot start its run ({first_line(e)})"
            raise UsageError(f"{message}: wandb login, or set WANDB_MODE=offline") from None
        self.run.define_metric("*", step_metric="global_step")

    def log_step(self, values: dict, global_step: int) -> None:
        self.run.log({"global_step": global_step, **numbers(values)})

    def log_epoch(self, record: dict, global_step: int) -> None:
        self.log_step({f"epoch/{key}": value for key, value in record.items()}, global_step)

    def replay(self, records: list[dict], epochs: list[dict], steps_per_epoch: int) -> None:
        """Every record kept, again and in order, each epoch's line after its steps' records: a kill
        may have cost the run what it got in its last seconds (W&B's service writes them every
        few seconds, and dies with the rank). None is missing; some come twice, alike."""
        epochs = list(epochs)
        for record in records:
            while epochs and epochs[0]["epoch"] < record["epoch"]:
                epoch = epochs.pop(0)
                self.log_epoch(epoch, epoch["epoch"] * steps_per_epoch)
            values = {k: v for k, v in record.items() if k not in ("epoch", "step", "global_step")}
            self.log_step(values, record["global_step"])
        for epoch in epochs:
            self.log_epoch(epoch, epoch["epoch"] * steps_per_epoch)


def numbers(values: dict) -> dict:
    """The values that are numbers: a record's phase table and slow rank stay in steps.jsonl."""
    return {key: value for key, value in values.items() if isinstance(value, (int, float))}


def started(args, records) -> list:
    """--tensorboard's and --wandb's sinks, for records (metrics.StepRecords, started: the records
    it kept); a continued run's W&B run is the same run, given every kept record again."""
    sinks = []
    if args.tensorboard:
        first_step = records.last["global_step"] + 1
        sinks.append(TensorBoardSink(records.path.with_name("tensorboard"), first_step))
    if args.wandb:
        wandb = WandbSink(args.wandb, records.saved["wandb_id"], vars(args), records.path.parent)
        wandb.replay(records.kept["global_step"], records.kept["epoch"], records.steps_per_epoch)
        sinks.append(wandb)
    return sinks
