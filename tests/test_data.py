"""The built-in images' batched augmentation, in process: equal to torchvision's per-image
transforms, and drawn per global batch so that every world size sees the same inputs."""

from __future__ import annotations

import pytest
import torch
from torchvision.transforms.v2 import functional as TF

from extras import builtin
import utils


def torchvision_crop_flip(
    image: torch.Tensor, top: int, left: int, flip: bool, padding: int
) -> torch.Tensor:
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
    out = builtin.random_crop_flip(images, top, left, flip, padding)
    for i in range(n):
        expected = torchvision_crop_flip(
            images[i], int(top[i]), int(left[i]), bool(flip[i]), padding
        )
        assert torch.equal(out[i], expected), (
            f"image {i}: top {top[i]}, left {left[i]}, flip {flip[i]}"
        )


def test_each_rank_gets_its_images_augmentation_of_the_global_batch(monkeypatch):
    """Rank r of W holds images r, r+W, ... of a global batch (DistributedSampler's order) and must
    crop and flip each as one process holding the whole batch does."""
    images = builtin.fake_images(64, 16, "train").tensors[0]
    transform = builtin.ImageBatchTransform(seed=3, padding=2)
    whole = transform(images, key=(0, 5))
    monkeypatch.setattr(utils.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(utils.dist, "get_world_size", lambda: 4)
    for rank in range(4):
        monkeypatch.setattr(utils.dist, "get_rank", lambda: rank)
        assert torch.equal(transform(images[rank::4], key=(0, 5)), whole[rank::4])
    monkeypatch.undo()
    raw = transform(images)  # no key (validation): normalised only
    changed = lambda a, b: sum(not torch.equal(x, y) for x, y in zip(a, b))  # noqa: E731
    # 25 offsets x 2 flips: about 2% of images stay as they were
    assert changed(whole, raw) > 50
    assert changed(whole, transform(images, key=(1, 5))) > 50  # another epoch
    assert changed(whole, transform(images, key=(0, 6))) > 50  # another step
    assert (
        changed(whole, builtin.ImageBatchTransform(4, 2)(images, key=(0, 5))) > 50
    )  # another seed
    assert torch.equal(
        whole, builtin.ImageBatchTransform(3, 2)(images, key=(0, 5))
    )  # and nothing else
