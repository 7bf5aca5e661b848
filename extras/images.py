"""An image folder (--dataset imagefolder: DATA_DIR/train/<class>/*, DATA_DIR/val/<class>/*) with
the recipe torchvision's classifiers are trained with: ImageFiles, torchvision's ImageFolder whose
JPEGs are decoded no larger than their crop needs, each crop drawn from (seed, epoch, index).
The scripts' build_datasets imports it where the flag asks for it, so that a run without it never
loads torchvision.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch
import torchvision
import torchvision.transforms.v2.functional as TF
from PIL import Image
from torch.utils.data import Dataset

from utils import UsageError, first_line

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# what --dataset imagefolder reads: torchvision's ImageFolder's extensions
IMAGE_EXTENSIONS = torchvision.datasets.folder.IMG_EXTENSIONS


def datasets(args) -> tuple[Dataset, Dataset, int]:
    """(train, val, classes) of --dataset imagefolder: uint8 crops, normalised on the device."""
    train, val = image_folders(Path(args.data_dir), args.image_size, args.seed, args.no_augment)
    for split in (train, val):
        split.batch_transform = Normalized(IMAGENET_MEAN, IMAGENET_STD)
    return train, val, len(train.classes)


class Normalized:
    """uint8 images normalised by mean and std, a batch at a time on the device (utils.
    batch_to_device calls it); their crops and flips were drawn where they were decoded."""

    def __init__(self, mean: tuple, std: tuple):
        self.mean, self.std = (torch.tensor(v).view(1, 3, 1, 1) * 255 for v in (mean, std))

    def __call__(self, images: torch.Tensor, key: tuple[int, int] | None = None) -> torch.Tensor:
        if self.mean.device != images.device:  # moved once, not every step
            self.mean, self.std = self.mean.to(images.device), self.std.to(images.device)
        return (images.float() - self.mean) / self.std


def image_folders(
    root: Path, image_size: int, seed: int, no_augment: bool
) -> tuple[Dataset, Dataset]:
    """DATA_DIR/train/<class>/* and DATA_DIR/val/<class>/*: training with the random-resized crop
    and flip (the validation crop with --no-augment), validation with the resize and center crop."""
    train = ImageFiles(root / "train", image_size, seed, augment=not no_augment)
    val = ImageFiles(root / "val", image_size, seed, augment=False)
    if train.classes != val.classes:
        raise UsageError(f"{root}/train and {root}/val have different class folders")
    return train, val


class ImageFiles(torchvision.datasets.ImageFolder):
    """ROOT/<class>/* as uint8 images of image_size, each decoded no larger than its crop needs.
    With augment, torchvision's RandomResizedCrop and a flip, drawn from (seed, epoch, index):
    any number of processes and workers, and a continued run, crop each image alike. Without,
    Resize(image_size * 256 / 224) and CenterCrop(image_size), as torchvision's classifiers are
    evaluated. Files whose names are not an image's (.txt) are left out."""

    # its crop and flip come from its own stream of (seed, epoch, index): seeds.per_sample leaves it
    seeds_itself = True

    def __init__(self, root: Path, image_size: int, seed: int, augment: bool):
        try:
            super().__init__(str(root), allow_empty=True)
        except OSError as e:  # a missing folder, or one without class folders
            raise UsageError(
                f"images not found under {root} ({first_line(e)}): --dataset imagefolder reads "
                "DATA_DIR/train/<class>/* and DATA_DIR/val/<class>/*"
            ) from None
        empty = sorted(set(self.classes) - {self.classes[t] for t in self.targets})
        if empty:
            raise UsageError(
                f"{root / empty[0]} holds no images ({', '.join(IMAGE_EXTENSIONS)}): add some or "
                "remove the folder"
            )
        self.image_size = image_size
        self.seed = seed
        self.augment = augment
        # In shared memory: the DataLoader's workers read what set_epoch writes here.
        self.epoch = torch.zeros((), dtype=torch.long).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose crops and flips __getitem__ draws (batches.epoch_loader calls it)."""
        self.epoch.fill_(epoch)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, target = self.samples[index]
        flip = False
        try:
            with Image.open(path) as image:
                if self.augment:
                    box, flip = self.random_crop(image.size, index)
                else:
                    box = center_crop(image.size, self.image_size)
                pixels = decode_crop(image, box, self.image_size)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            raise UsageError(
                f"cannot read {path} ({first_line(e)}): remove or replace it"
            ) from None
        if flip:
            pixels = pixels.flip(2)
        return pixels, target

    def random_crop(self, size: tuple[int, int], index: int) -> tuple[tuple, bool]:
        """torchvision's RandomResizedCrop box (scale 0.08 to 1, ratio 3/4 to 4/3) and a flip,
        drawn from (seed, epoch, index) alone."""
        rng = random.Random(f"{self.seed}/{int(self.epoch)}/{index}")
        width, height = size
        for _ in range(10):
            area = width * height * rng.uniform(0.08, 1.0)
            ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
            w = round(math.sqrt(area * ratio))
            h = round(math.sqrt(area / ratio))
            if 0 < w <= width and 0 < h <= height:
                top = rng.randint(0, height - h)
                left = rng.randint(0, width - w)
                return (left, top, left + w, top + h), rng.random() < 0.5
        # Ten misses (a very long image): the center, cut to the nearest ratio allowed.
        w = min(width, round(height * 4 / 3))
        h = min(height, round(width * 4 / 3))
        left = (width - w) // 2
        top = (height - h) // 2
        return (left, top, left + w, top + h), rng.random() < 0.5


def center_crop(size: tuple[int, int], image_size: int) -> tuple[float, float, float, float]:
    """Resize(image_size * 256 / 224) then CenterCrop(image_size), as a box of the image's own
    pixels."""
    width, height = size
    side = image_size * min(width, height) / int(image_size * 256 / 224)
    left = (width - side) / 2
    top = (height - side) / 2
    return (left, top, left + side, top + side)


def decode_crop(image: Image.Image, box: tuple, image_size: int) -> torch.Tensor:
    """The box of an opened image as uint8 RGB (3, image_size, image_size). A JPEG is decoded at
    1/2, 1/4 or 1/8 of its size (libjpeg's scaling, through draft()) where the box still has
    image_size pixels each way; other formats at their own size."""
    left, top, right, bottom = box
    width, height = image.size
    needed = (
        math.ceil(width * image_size / (right - left)),
        math.ceil(height * image_size / (bottom - top)),
    )
    image.draft("RGB", needed)
    # The box in the pixels the image is decoded to.
    x = image.size[0] / width
    y = image.size[1] / height
    image = image.crop((round(left * x), round(top * y), round(right * x), round(bottom * y)))
    # Greyscale, CMYK and palette images as RGB.
    if image.mode != "RGB":
        image = image.convert("RGB")
    # torchvision's resize of uint8 tensors: three times as fast as Pillow's here.
    pixels = TF.pil_to_tensor(image)
    return TF.resize(pixels, [image_size, image_size], antialias=True)
