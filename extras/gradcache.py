"""Gradient accumulation's step for a loss over the whole global batch (GradCache; open_clip's
--accum-freq): distributed_grad_accum.py steps with train_step where compute_loss calls
extras/batches.py's whole_batch, whose loss needs all of a step's micro-batches' outputs at once.
Each micro-batch's outputs are computed without gradients and joined (Joined), the loss and its
gradient at them taken once, then each micro-batch's forward runs again with the random draws it
made (model_streams, draw_again) and its backward from its rows of that gradient.
"""

from __future__ import annotations

import contextlib
import random

import torch

from utils import UsageError, forward, loss_for_backward, tree_flatten, tree_unflatten


def train_step(run, micro_batches, compute_loss) -> dict:
    """distributed_grad_accum.py's train_step (run: its Training) for a loss over the whole batch:
    each micro-batch's forward without gradients, the loss over the whole step and its gradient at
    the outputs, then each micro-batch's forward again (drawing what it drew: dropout) and its
    backward from its rows of that gradient. K micro-batches train what one batch K times larger
    does, with one micro-batch's activations in memory, for a second forward's time."""
    model, optimizer = run.model, run.optimizer
    optimizer.zero_grad(set_to_none=True)
    micro_batches = list(micro_batches)  # the step's inputs, for the second forward
    samples = [n for _, _, n in micro_batches]
    parts, draws = [], []
    # The outputs without gradients; batch-norm statistics (all buffers) move in the second forward
    # only.
    kept = [buffer.clone() for buffer in model.buffers()]
    with torch.no_grad():
        for inputs, _, _ in micro_batches:
            draws.append(model_streams())
            parts.append(forward(model, inputs))
        for buffer, saved in zip(model.buffers(), kept):
            buffer.copy_(saved)
    targets = Joined([targets for _, targets, _ in micro_batches], samples).whole
    outputs = Joined(parts, samples, grad=True)
    # The loss over all ranks' whole step (whole_batch's all-gathers), and its gradient at the
    # outputs, weighted by this rank's part of the step as any loss. A (sum, count) is the whole
    # step's on every rank, its count too (not this rank's part's), which the core all-reduces.
    loss = compute_loss(outputs.whole, targets)
    loss_for_backward(loss, *run.samples).backward()
    run.weighted = run.samples  # the script's check that the loss was weighted
    run.recorder.meter.update(loss, outputs.whole, targets, run.samples[0])
    for i, (inputs, _, _) in enumerate(micro_batches):
        # DDP all-reduces in the last micro-batch's backward only, whatever
        # --sync-every-micro-batch says: an output that is not a row per sample (CLIP's temperature)
        # gets its gradient in that backward alone, and a synced one without it would not finish
        with contextlib.nullcontext() if i == len(micro_batches) - 1 else model.no_sync():
            draw_again(draws[i])
            outputs.backward(i, forward(model, inputs))
    grad_norm = None
    if run.args.clip_grad:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), run.args.clip_grad)
    optimizer.step()
    run.scheduler.step()
    return dict(grad_norm=grad_norm)


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


def model_streams() -> tuple:
    """Where the model's next draws (dropout) come from: torch's streams on the CPU and the GPUs,
    and Python's; draw_again(state) sets them back there, so that a forward run again draws what it
    drew. No GPU work: a generator's state is kept on the host."""
    gpus = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), gpus, random.getstate()


def draw_again(state: tuple) -> None:
    """The random streams set back to model_streams()'s state."""
    cpu, gpus, python = state
    torch.set_rng_state(cpu)
    if gpus is not None:
        torch.cuda.set_rng_state_all(gpus)
    random.setstate(python)
