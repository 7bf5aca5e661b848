"""The batched augmentation against torchvision's per-image transforms, in process."""
from __future__ import annotations

import pytest
import torch
from torchvision.transforms.v2 import functional as TF

import utils


def torchvision_crop_flip(image: torch.Tensor, top: int, left: int, flip: bool, padding: int) -> torch.Tensor:
    """RandomCrop(size, padding) then RandomHorizontalFlip, with the draws given."""
    h, w = image.shape[1:]
    image = TF.crop(TF.pad(image, [padding]), top, left, h, w)
    return TF.horizontal_flip(image) if flip else image


@pytest.mark.parametrize("size, padding", [(16, 2), (32, 4), (13, 3)])
def test_batched_crop_and_flip_equal_torchvision_per_image(size, padding):
    generator = torch.Generator().manual_seed(size)
    n = 4 * (2 * padding + 1)  # enough images to meet every offset
    images = torch.randint(0, 256, (n, 3, size, size + 1), dtype=torch.uint8, generator=generator)
    top = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
    left = torch.arange(n) % (2 * padding + 1)  # every left edge, both flipped and not
    flip = torch.arange(n) // (2 * padding + 1) % 2 == 1
    out = utils.random_crop_flip(images, top, left, flip, padding)
    for i in range(n):
        expected = torchvision_crop_flip(images[i], int(top[i]), int(left[i]), bool(flip[i]), padding)
        assert torch.equal(out[i], expected), f"image {i}: top {top[i]}, left {left[i]}, flip {flip[i]}"


def test_each_image_gets_its_own_augmentation_from_seed_epoch_and_index():
    data = utils.fake_images(64, 16, "train")
    augmented = utils.AugmentedBatches(data, seed=3, padding=2)
    alone = augmented.__getitems__([(5, 0)])[0][0]
    in_a_batch = augmented.__getitems__([(9, 0), (5, 0), (1, 0)])[0][1]
    assert torch.equal(alone, in_a_batch)  # not the batch, rank or worker: only (seed, epoch, index)
    assert torch.equal(utils.AugmentedBatches(data, 3, 2).__getitems__([(5, 0)])[0][0], alone)
    every = list(range(64))
    epoch0 = augmented.__getitems__([(i, 0) for i in every])[0]
    epoch1 = augmented.__getitems__([(i, 1) for i in every])[0]
    other_seed = utils.AugmentedBatches(data, 4, 2).__getitems__([(i, 0) for i in every])[0]
    raw = data.__getitems__(every)[0]
    changed = lambda a, b: sum(not torch.equal(x, y) for x, y in zip(a, b))  # noqa: E731
    # 25 offsets x 2 flips: about 2% of images stay as they were
    assert changed(epoch0, raw) > 50 and changed(epoch0, epoch1) > 50 and changed(epoch0, other_seed) > 50
