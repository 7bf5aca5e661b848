"""Batch norm over the global batch on CPU processes (--sync-bn on gloo): PyTorch's SyncBatchNorm
has no CPU kernel, so there each batch-norm layer becomes a GlobalBatchNorm, whose batch mean and
variance are all-reduced over the ranks with their gradients, for any part sizes."""

from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class SumOverRanks(torch.autograd.Function):
    """Every rank calls it: the tensor summed over all ranks. Every rank's sum depends on this
    rank's tensor, so its gradient is the sum of all ranks' gradients."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        total = tensor.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        total = grad.clone()
        dist.all_reduce(total)
        return total


class GlobalBatchNorm(nn.Module):
    """A batch-norm layer (BatchNorm1d, 2d or 3d: its weights, statistics and state_dict keys)
    whose training statistics are all-reduced by SumOverRanks: the mean and (biased) variance of
    every rank's samples together, as one process computes them over the whole batch. Evaluation
    is the layer's own, on each rank alone."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.eps, self.momentum = layer.eps, layer.momentum
        self.weight, self.bias = layer.weight, layer.bias
        self.register_buffer("running_mean", layer.running_mean)
        self.register_buffer("running_var", layer.running_var)
        self.register_buffer("num_batches_tracked", layer.num_batches_tracked)
        self.train(layer.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # evaluation: the running statistics, or (none kept) this rank's batch's, with no
        # collective, as validation shards differ in length
        if not self.training:
            batch_statistics = self.running_mean is None
            return F.batch_norm(
                x,
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                batch_statistics,
                0.0,
            )
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        # in float32 at least, as PyTorch's kernels compute a half-precision batch's statistics
        values = x.to(torch.promote_types(x.dtype, torch.float32))
        count = torch.tensor([x.numel() // x.size(1)], dtype=values.dtype, device=x.device)
        # all-reduce, every rank: the global batch's sums and count, then the squared deviations
        # from its mean (two passes, as exact as one process's variance)
        sums = SumOverRanks.apply(torch.cat([values.sum(dims), count]))
        total = sums[-1].detach()
        mean = sums[:-1] / total
        centred = values - mean.view(shape)
        variance = SumOverRanks.apply(centred.square().sum(dims)) / total
        if self.running_mean is not None:
            self.update_running_stats(mean.detach(), variance.detach(), total)
        normalised = centred * torch.rsqrt(variance + self.eps).view(shape)
        if self.weight is not None:
            normalised = normalised * self.weight.view(shape) + self.bias.view(shape)
        return normalised.to(x.dtype)

    @torch.no_grad()
    def update_running_stats(self, mean, variance, total) -> None:
        """As PyTorch's batch norm: the unbiased variance, momentum or (None) a cumulative mean."""
        self.num_batches_tracked.add_(1)
        momentum = self.momentum
        if momentum is None:
            momentum = 1.0 / self.num_batches_tracked.item()
        unbiased = variance * total / (total - 1).clamp(min=1)
        self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
        self.running_var.mul_(1 - momentum).add_(
            unbiased.to(self.running_var.dtype), alpha=momentum
        )


def convert_to_global(module: nn.Module) -> nn.Module:
    """module with each batch-norm layer made a GlobalBatchNorm holding its weights and
    statistics, as nn.SyncBatchNorm.convert_sync_batchnorm does for GPUs."""
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)):
        return GlobalBatchNorm(module)
    for name, child in module.named_children():
        module.add_module(name, convert_to_global(child))
    return module
