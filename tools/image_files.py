"""Folders of JPEGs written from a seed, for the tests and the benchmark (no download):
ROOT/train/<class>/*.jpg and ROOT/val/<class>/*.jpg. Each class is a colour under a smooth random
field and grain, so a random-resized crop of any part of an image still shows its class.

    python tools/image_files.py ROOT --shape imagenet --per-class 100
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

COLOURS = [(210, 60, 50), (60, 170, 70), (50, 80, 200), (200, 180, 40), (150, 60, 180)]


def imagenet_size(rng: np.random.Generator) -> tuple[int, int]:
    """As most of ImageNet's photos: 400 to 600 wide, 300 to 450 high."""
    return int(rng.integers(400, 601)), int(rng.integers(300, 451))


def phone_size(rng: np.random.Generator) -> tuple[int, int]:
    """A 12-megapixel phone photo."""
    return 4000, 3000


def varied_size(rng: np.random.Generator) -> tuple[int, int]:
    """Small, of aspect ratios from 1:4 to 4:1: quick to train on, hard to crop."""
    return int(rng.integers(40, 161)), int(rng.integers(40, 161))


SHAPES = {"imagenet": imagenet_size, "phone": phone_size, "varied": varied_size}


def photo(rng: np.random.Generator, size: tuple[int, int], colour: tuple) -> Image.Image:
    """The class colour, shifted a little for each image, under a smooth random field (what a JPEG
    compresses as a photo) and grain."""
    width, height = size
    small = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8))
    field = np.asarray(small.resize(size, Image.Resampling.BICUBIC), dtype=np.int16)
    grain = rng.integers(-12, 13, (height, width, 3), dtype=np.int16)
    tint = np.array(colour, dtype=np.int16) + rng.integers(-30, 31, 3, dtype=np.int16)
    pixels = (tint * 2 + field * 3) // 5 + grain
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8))


def write_image_folder(
    root: Path,
    shape: str,
    classes: int,
    train_per_class: int,
    val_per_class: int,
    seed: int = 0,
    quality: int = 90,
) -> Path:
    """root/train and root/val of JPEGs of the shape's sizes, the same files for the same seed."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                image = photo(rng, SHAPES[shape](rng), COLOURS[c % len(COLOURS)])
                image.save(folder / f"{i}.jpg", quality=quality)
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="the folder to write train/ and val/ in")
    parser.add_argument("--shape", choices=SHAPES, default="imagenet", help="the images' sizes")
    parser.add_argument("--classes", type=int, default=4, help="class folders per split")
    parser.add_argument("--per-class", type=int, default=100, help="training images per class")
    parser.add_argument("--val-per-class", type=int, default=25, help="validation images per class")
    parser.add_argument("--seed", type=int, default=0, help="the same seed writes the same files")
    args = parser.parse_args()
    write_image_folder(
        args.root, args.shape, args.classes, args.per_class, args.val_per_class, args.seed
    )


if __name__ == "__main__":
    main()
