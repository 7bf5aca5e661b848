"""A project's own validation metrics (build_metrics: torchmetrics'), updated on each rank's
unpadded share of the validation set and computed over all ranks' states, so that every validation
sample counts once, as in one process: also for metrics that are no sums over ranks (AUROC, macro
F1, mAP). torchmetrics itself is imported only by the user's function.
"""

from __future__ import annotations

import warnings

import torch

from utils import UsageError, all_gather_objects, logits


class UserMetrics:
    """build_metrics' metrics (torchmetrics': a dict of Metrics, or a MetricCollection), updated
    with every validation batch's scores (the model's outputs, or their logits) and targets on its
    rank, and computed over all ranks' (torchmetrics' own all-gather of their states), so every
    validation sample counts once, as in one process: also AUROC, macro F1 or mAP, which are no
    sums. Each is recorded as val_<name> (a metric that computes a dict: val_<name>_<key>)."""

    def __init__(self, metrics, device: torch.device):
        # A MetricCollection: the names are its own.
        if not isinstance(metrics, dict):
            if not hasattr(metrics, "keys"):
                raise UsageError(
                    f"build_metrics returned a {type(metrics).__name__}: return a dict of"
                    " torchmetrics Metrics, or a MetricCollection"
                )
            metrics = {"": metrics}
        # torchmetrics' Metric is a Module: a plain function cannot be gathered over the ranks
        for name, metric in metrics.items():
            if not isinstance(metric, torch.nn.Module):
                raise UsageError(
                    f"build_metrics' {name!r} is a {type(metric).__name__}: give a torchmetrics"
                    " Metric, which counts every validation sample once over all ranks"
                )
        self.metrics = {name: metric.to(device) for name, metric in metrics.items()}
        self.device = device

    def list_states(self) -> list[list]:
        """Each metric's states that are lists of tensors (kept predictions: AUROC's, mAP's), in
        one order on every rank."""
        states = []
        for metric in self.metrics.values():
            for part in metric.values() if hasattr(metric, "keys") else [metric]:
                states += [s for s in part.metric_state.values() if isinstance(s, list)]
        return states

    def shape_empty_states(self) -> None:
        """Every rank calls it (an all-gather): a rank that kept no prediction gets an empty one of
        the others' shape, which torchmetrics' all-gather needs (an empty list aborts it)."""
        states = self.list_states()
        if not states:
            return
        shapes = [None] * len(states)
        for i, state in enumerate(states):
            if state:
                shapes[i] = (tuple(state[0].shape[1:]), state[0].dtype)
        everyone = all_gather_objects(shapes)
        for i, state in enumerate(states):
            found = next((shape[i] for shape in everyone if shape[i] is not None), None)
            if not state and found is not None:
                shape, dtype = found
                state.append(torch.empty((0, *shape), dtype=dtype, device=self.device))

    def names(self) -> list[str]:
        """The names they are recorded under (a metric that computes a dict adds its keys)."""
        names = []
        for name, metric in self.metrics.items():
            if name:
                names.append(f"val_{name}")
            else:
                names += [f"val_{key}" for key in metric.keys()]
        return names

    def update(self, outputs, targets) -> None:
        """A validation batch of this rank: nothing read back here."""
        scores = logits(outputs)
        for metric in self.metrics.values():
            metric.update(scores, targets)

    def compute(self) -> dict:
        """Every rank calls it (torchmetrics' all-gathers): val_<name> of every metric, over all
        ranks; then each starts again, for the next validation."""
        self.shape_empty_states()
        values = {}
        for name, metric in self.metrics.items():
            with warnings.catch_warnings():
                # a rank without validation samples (fewer than the ranks) computes too
                warnings.filterwarnings("ignore", ".*before the ``update``")
                value = metric.compute()
            if not isinstance(value, dict):
                value = {"": value}
            for key, item in value.items():
                full = "_".join(part for part in ("val", name, key) if part)
                values[full] = as_number(item)
            metric.reset()
        return values


def as_number(value):
    """A metric's value for the records: a float, or a list of them (a per-class value)."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return value.item()
        return value.tolist()
    return value
