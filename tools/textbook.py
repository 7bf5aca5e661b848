"""The textbook DDP loop, for the benchmark to measure ours against: what the tutorials and public
example repositories write. The same model, data, batch and recipe as the scripts, but the input
pipeline of a CIFAR tutorial: a Dataset that turns each uint8 image into a PIL image and applies
torchvision's RandomCrop, RandomHorizontalFlip, ToTensor and Normalize in the DataLoader's workers
(an image folder: ImageFolder with RandomResizedCrop, as pytorch/examples' imagenet/main.py);
a DistributedSampler; DDP; on a GPU autocast float16 with a GradScaler; loss.item() every step.

    torchrun --standalone --nproc_per_node=2 tools/textbook.py --dataset fake --fake-size 8192 --arch tiny --epochs 3

It writes the metrics.jsonl fields the benchmark reads. No resume, no exact validation, no error
handling: it stands for what a user would otherwise run, not for what we recommend.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# the same fake images and model as the scripts, and the same flags and learning-rate schedule
import utils  # noqa: E402
from extras import builtin, metrics  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchvision  # noqa: E402
import torchvision.transforms as T  # noqa: E402
from PIL import Image  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, Dataset, DistributedSampler  # noqa: E402


class CIFARStyle(Dataset):
    """What torchvision's CIFAR10 does per item: an HWC uint8 array to a PIL image, then the transform."""

    def __init__(self, images: builtin.ImageTensors, transform):
        self.data = images.tensors[0].permute(0, 2, 3, 1).numpy()
        self.targets, self.transform = images.tensors[1].tolist(), transform

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        return self.transform(Image.fromarray(self.data[index])), self.targets[index]


def fake_images(size: int, image_size: int) -> tuple[Dataset, Dataset]:
    """The scripts' fake images through CIFAR's tutorial transforms."""
    normalize = T.Normalize(builtin.CIFAR_MEAN, builtin.CIFAR_STD)
    train_tf = T.Compose(
        [
            T.RandomCrop(image_size, padding=image_size // 8),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            normalize,
        ]
    )
    train_set = CIFARStyle(builtin.fake_images(size, image_size, "train"), train_tf)
    val_set = CIFARStyle(
        builtin.fake_images(size // builtin.FAKE_VAL_FRACTION, image_size, "val"),
        T.Compose([T.ToTensor(), normalize]),
    )
    return train_set, val_set


def image_folders(root: Path, image_size: int) -> tuple[Dataset, Dataset]:
    """pytorch/examples' imagenet/main.py: each image decoded whole by PIL, then
    RandomResizedCrop, flip, ToTensor and Normalize; Resize and CenterCrop for validation."""
    normalize = T.Normalize(builtin.IMAGENET_MEAN, builtin.IMAGENET_STD)
    train_tf = T.Compose(
        [T.RandomResizedCrop(image_size), T.RandomHorizontalFlip(), T.ToTensor(), normalize]
    )
    val_tf = T.Compose(
        [
            T.Resize(int(image_size * 256 / 224)),
            T.CenterCrop(image_size),
            T.ToTensor(),
            normalize,
        ]
    )
    return (
        torchvision.datasets.ImageFolder(root / "train", train_tf),
        torchvision.datasets.ImageFolder(root / "val", val_tf),
    )


def parse_args() -> argparse.Namespace:
    """The scripts' own flags and defaults (workers, the peak lr from the batch); this loop uses the workload's."""
    parser = utils.build_parser(__doc__.splitlines()[0])
    args = parser.parse_args()
    utils.check_args(args)
    if args.dataset not in ("fake", "imagefolder"):
        parser.error("the textbook loop reads --dataset fake or imagefolder only")
    return args


def main() -> None:
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    workers = args.workers

    if args.dataset == "imagefolder":
        train_set, val_set = image_folders(Path(args.data_dir), args.image_size)
        classes = len(train_set.classes)
    else:
        train_set, val_set = fake_images(args.fake_size, args.image_size)
        classes = builtin.FAKE_CLASSES
    sampler = DistributedSampler(train_set, seed=args.seed, drop_last=True)
    batch = args.batch_size // world_size
    loader = DataLoader(
        train_set,
        batch,
        sampler=sampler,
        num_workers=workers,
        pin_memory=cuda,
        drop_last=True,
        persistent_workers=workers > 0,
    )
    val_loader = DataLoader(
        val_set, batch, sampler=DistributedSampler(val_set, shuffle=False), num_workers=workers
    )

    torch.manual_seed(args.seed)
    model = builtin.model(args.arch, classes, args.image_size).to(device)
    model = DDP(model, device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay
    )
    scheduler = utils.warmup_cosine(optimizer, args.epochs * len(loader), args.warmup)
    scaler = torch.amp.GradScaler(device.type, enabled=cuda)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        running_loss, seen, data_wait = 0.0, 0, 0.0
        start = tick = time.perf_counter()
        for step, (images, labels) in enumerate(loader, 1):
            data_wait += time.perf_counter() - tick
            images, labels = (
                images.to(device, non_blocking=True),
                labels.to(device, non_blocking=True),
            )
            with torch.autocast(device.type, dtype=torch.float16, enabled=cuda):
                loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            running_loss += loss.item() * len(labels)
            seen += len(labels)
            if rank == 0 and step % args.print_freq == 0:
                print(
                    f"epoch {epoch + 1} step {step}/{len(loader)} loss {running_loss / seen:.4f}",
                    flush=True,
                )
            tick = time.perf_counter()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        val_correct, val_seen = evaluate(model, val_loader, device)
        totals = torch.tensor(
            [running_loss, seen, val_correct, val_seen], dtype=torch.float64, device=device
        )
        dist.all_reduce(totals)
        if rank == 0:
            record = dict(
                epoch=epoch + 1,
                train_loss=totals[0].item() / totals[1].item(),
                val_acc=totals[2].item() / totals[3].item(),
                epoch_time_s=seconds,
                images_per_s=totals[1].item() / seconds,
                data_wait_s=data_wait,
                world_size=world_size,
                **metrics.memory_mb(model, optimizer, device),
            )
            print(json.dumps(record), flush=True)
            Path(args.output_dir).mkdir(parents=True, exist_ok=True)
            utils.append_metrics(Path(args.output_dir) / "metrics.jsonl", record)
    dist.destroy_process_group()


@torch.no_grad()
def evaluate(model, loader, device) -> tuple[int, int]:
    model.eval()
    correct = seen = 0
    for images, labels in loader:
        with torch.autocast(device.type, dtype=torch.float16, enabled=device.type == "cuda"):
            outputs = model(images.to(device))
        correct += (outputs.argmax(1).cpu() == labels).sum().item()
        seen += len(labels)
    return correct, seen


if __name__ == "__main__":
    main()
