"""The built-in data and models, which the scripts' build_datasets() and build_model() return unless
you replace them: --dataset (CIFAR-10/100, an image folder, fake images) and --arch (tiny, or any
torchvision classifier). A user whose own functions replace those bodies needs nothing here. The
images come as uint8 and carry a batch_transform that finishes them a batch at a time on the
device (utils.batch_to_device calls it): CIFAR's and fake images are cropped, flipped and
normalised there (an image folder: images.py). A user's own Dataset never goes through it.
torchvision is imported where a flag needs it (a torchvision model, CIFAR).
"""

from __future__ import annotations

import contextlib
import math
import os

import numpy as np

import torch
import torch.nn as nn
from torch.utils.data import Dataset, TensorDataset

from utils import UsageError, errors_shared_by_all_ranks, first_line, rank, to_device, world_size

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
FAKE_CLASSES = 10
FAKE_VAL_FRACTION = 5  # fake validation set = fake_size // 5 images


def datasets(args) -> tuple[Dataset, Dataset, int]:
    """(train, val, classes) for --dataset cifar10, cifar100 or fake: uint8 images with a
    batch_transform for the device (an image folder: images.datasets)."""
    if args.dataset == "fake":
        train = fake_images(args.fake_size, args.image_size, "train")
        val = fake_images(max(1, args.fake_size // FAKE_VAL_FRACTION), args.image_size, "val")
    else:
        train, val = cifar(args)
    padding = 0 if args.no_augment else args.image_size // 8
    train.batch_transform = ImageBatchTransform(args.seed, padding)
    val.batch_transform = ImageBatchTransform(args.seed, 0)
    return train, val, len(train.classes)


class ImageTensors(TensorDataset):
    """A whole image set held as one uint8 tensor (N, 3, H, W), and its labels: CIFAR and fake
    data."""

    # a sample draws nothing: its crop and flip are drawn a batch at a time on the device
    seeds_itself = True

    def __init__(self, images: np.ndarray, targets, classes: list[str]):
        super().__init__(
            torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(), torch.as_tensor(targets)
        )
        self.classes = list(classes)


def fake_images(size: int, image_size: int, split: str, seed: int = 0) -> ImageTensors:
    """Learnable uint8 images held like CIFAR: a colour pattern per class, plus noise; fixed by
    (seed, split)."""
    patterns = (
        np.random.default_rng(seed).integers(0, 256, (FAKE_CLASSES, 4, 4, 3)).astype(np.float32)
    )
    repeat = math.ceil(image_size / 4)  # 4x4 blocks of colour, cut to the image size
    patterns = patterns.repeat(repeat, 1).repeat(repeat, 2)[:, :image_size, :image_size]
    rng = np.random.default_rng(seed * 10 + {"train": 1, "val": 2}[split])
    targets = rng.integers(0, FAKE_CLASSES, size)
    noise = rng.normal(0, 64, (size, image_size, image_size, 3)).astype(np.float32)
    images = np.clip(patterns[targets] * 0.6 + 50 + noise, 0, 255).astype(np.uint8)
    return ImageTensors(images, targets, [str(c) for c in range(FAKE_CLASSES)])


def cifar(args) -> tuple[ImageTensors, ImageTensors]:
    """CIFAR-10 or -100, downloaded by one process per machine while the others wait; all fail
    alike."""
    import torchvision

    cls = (
        torchvision.datasets.CIFAR10 if args.dataset == "cifar10" else torchvision.datasets.CIFAR100
    )
    with errors_shared_by_all_ranks():
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            try:  # one archive holds both splits
                cls(args.data_dir, download=not args.no_download)
            except (RuntimeError, OSError) as e:
                how = "--no-download was given" if args.no_download else "the download failed"
                raise UsageError(
                    f"{args.dataset} not found in {args.data_dir} and {how} ({first_line(e)})"
                ) from None
    splits = (cls(args.data_dir, train=train) for train in (True, False))
    return tuple(ImageTensors(d.data, d.targets, d.classes) for d in splits)


class ImageBatchTransform:
    """Built-in uint8 images, a batch at a time on the device: random crop and flip (padding > 0),
    then normalised by mean and std. The draws of a global batch come from (seed, epoch, step), and
    rank r keeps those of its images r, r+W, ... (DistributedSampler's order): 1 and W processes,
    and a resumed run, see identical inputs."""

    def __init__(self, seed: int, padding: int, mean: tuple = CIFAR_MEAN, std: tuple = CIFAR_STD):
        self.seed, self.padding = seed, padding
        self.mean, self.std = (torch.tensor(v).view(1, 3, 1, 1) * 255 for v in (mean, std))

    def __call__(self, images: torch.Tensor, key: tuple[int, int] | None = None) -> torch.Tensor:
        if self.padding and key is not None:
            world = world_size()
            # a stream per (seed, epoch, step); each image's three draws (two shifts, a flip) in
            # turn, so that an image's draws depend on its place alone, also where the ranks' shares
            # differ by one
            seed = np.random.SeedSequence([self.seed, *key]).generate_state(1)[0]
            generator = torch.Generator().manual_seed(int(seed))
            draws = torch.rand(world * len(images), 3, generator=generator)[rank() :: world]
            draws = to_device(draws[: len(images)], images.device)
            shifts = (draws[:, :2] * (2 * self.padding + 1)).long()
            flips = draws[:, 2] < 0.5
            images = random_crop_flip(images, shifts[:, 0], shifts[:, 1], flips, self.padding)
        if self.mean.device != images.device:  # moved once, not every step
            self.mean, self.std = self.mean.to(images.device), self.std.to(images.device)
        return (images.float() - self.mean) / self.std


def random_crop_flip(
    images: torch.Tensor, top: torch.Tensor, left: torch.Tensor, flip: torch.Tensor, padding: int
) -> torch.Tensor:
    """RandomCrop(size, padding) at (top[i], left[i]), then a flip if flip[i], for a whole batch."""
    n, c, h, w = images.shape
    padded = nn.functional.pad(images, (padding,) * 4)
    rows = top.view(n, 1) + torch.arange(h, device=images.device)
    cols = left.view(n, 1) + torch.arange(w, device=images.device)
    # a flipped crop reads its columns backwards
    cols = torch.where(flip.view(n, 1), cols.flip(1), cols)
    padded = padded.gather(2, rows.view(n, 1, h, 1).expand(n, c, h, w + 2 * padding))
    return padded.gather(3, cols.view(n, 1, 1, w).expand(n, c, h, w))


def model(arch: str, num_classes: int, image_size: int) -> nn.Module:
    """tiny, or any torchvision classifier, tried on one image of image_size: a clear line, naming a
    size that works, for one that cannot take it."""
    # GroupNorm (no batch statistics), GELU, no max-pool: world sizes agree to 1e-5
    if arch == "tiny":
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, 1, 1),
            nn.GroupNorm(8, 16),
            nn.GELU(),
            nn.Conv2d(16, 32, 3, 2, 1),
            nn.GroupNorm(8, 32),
            nn.GELU(),
            nn.Conv2d(32, 64, 3, 2, 1),
            nn.GroupNorm(8, 64),
            nn.GELU(),
            # 4x4 cells: where, not what
            nn.AdaptiveAvgPool2d(4),
            nn.Flatten(),
            nn.Linear(64 * 16, num_classes),
        )
    import torchvision

    if arch not in torchvision.models.list_models(module=torchvision.models):
        raise UsageError(
            f"unknown --arch {arch!r}: use tiny or a torchvision classifier such as resnet18,"
            " vit_b_16"
        )
    # vit_b_16 at 40 px: "indivisible by patch size"; inception_v3 at 32 px: "Kernel size can't be
    # greater"
    try:
        net = torchvision_model(arch, num_classes, image_size)
        with torch.no_grad():  # in eval mode: no statistics updated, no random numbers drawn
            net.eval()(torch.zeros(1, 3, image_size, image_size))
        return net.train()
    except (RuntimeError, ValueError, AssertionError, TypeError, IndexError) as e:
        raise UsageError(cannot_take(arch, image_size, e)) from None


def torchvision_model(arch: str, num_classes: int, image_size: int) -> nn.Module:
    import torchvision

    """No auxiliary heads (googlenet, inception_v3): training uses one output; small images: a
    ResNet 3x3 stem."""
    extra = {"image_size": image_size} if arch.startswith("vit_") else {}
    if arch in ("googlenet", "inception_v3"):
        extra.update(aux_logits=False, init_weights=True)
    model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **extra)
    if image_size <= 64 and isinstance(model, torchvision.models.ResNet):
        # the ImageNet stem would shrink 32x32 inputs to 8x8 before the first block
        model.conv1 = nn.Conv2d(3, model.conv1.out_channels, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
    return model


def cannot_take(arch: str, image_size: int, error: Exception) -> str:
    """The line for a model that cannot take image_size, naming the smallest multiple of 8 that
    works."""
    line = f"--arch {arch} cannot take {image_size}x{image_size} images ({first_line(error)})"
    for size in range(image_size // 8 * 8 + 8, 520, 8):
        with contextlib.suppress(Exception), torch.no_grad():
            torchvision_model(arch, 2, size).eval()(torch.zeros(1, 3, size, size))
            return f"{line}: use --image-size {size} or another --arch"
    return f"{line}: use another --arch"
