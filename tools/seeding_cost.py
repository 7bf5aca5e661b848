"""What seeding each sample costs (seeds.per_sample): a bare index, and a JPEG decoded, cropped and
flipped with torchvision's transforms, each read as a rank reads it without workers (the model's
torch stream kept aside and given back).

    python tools/seeding_cost.py
"""

from __future__ import annotations

import argparse
import io
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
from PIL import Image
from torchvision.transforms import v2 as T
from extras import seeds


class Plain(torch.utils.data.Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        return i


class Jpegs(torch.utils.data.Dataset):
    def __init__(self):
        buffer = io.BytesIO()
        Image.fromarray(torch.randint(0, 256, (375, 500, 3), dtype=torch.uint8).numpy()).save(
            buffer, "JPEG"
        )
        self.data = buffer.getvalue()
        self.transform = T.Compose(
            [T.PILToTensor(), T.RandomResizedCrop(224, antialias=True), T.RandomHorizontalFlip()]
        )

    def __len__(self):
        return 1000

    def __getitem__(self, i):
        with Image.open(io.BytesIO(self.data)) as image:
            return self.transform(image.convert("RGB"))


argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
n = 20000
for name, d in [
    ("plain index", Plain()),
    ("500x375 JPEG + RandomResizedCrop(224) + flip", Jpegs()),
]:
    k = n if name == "plain index" else 200
    bare = min(timeit.repeat(lambda: [d[i % 1000] for i in range(k)], number=1, repeat=3)) / k * 1e6
    seeded = seeds.per_sample(d, 0)
    with_seeds = (
        min(timeit.repeat(lambda: [seeded[i % 1000] for i in range(k)], number=1, repeat=3))
        / k
        * 1e6
    )
    print(f"{name}: {bare:.1f} us a sample, seeded {with_seeds:.1f} us (+{with_seeds - bare:.1f})")
