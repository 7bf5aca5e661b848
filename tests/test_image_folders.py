"""--dataset imagefolder: torchvision's recipe (a random-resized crop and a flip for training, a
resize and a center crop for validation), each image decoded no larger than its crop needs, the
same inputs on any number of processes and workers and in a continued run, and a file that
cannot be read named in one line on every rank."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as TF
from PIL import Image

from extras import images
import utils
from image_files import photo, write_image_folder
from processes import (
    ends_every_rank_with,
    max_weight_difference,
    metrics,
    python,
    run,
    run_parallel,
    start,
    finish,
    torchrun,
    wait_for,
)
from test_distributed import readme_main_job

# Learnable in 3 epochs (about 0.95 validation accuracy), 18 steps an epoch at batch 32.
EXACT = [
    "--dataset",
    "imagefolder",
    "--arch",
    "tiny",
    "--image-size",
    "24",
    "--batch-size",
    "32",
    "--epochs",
    "3",
    "--print-freq",
    "5",
    "--timeout",
    "60",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """4 classes of 150 training and 20 validation JPEGs, 40 to 160 pixels each way; among them a
    greyscale and a CMYK JPEG, a PNG, a WebP and a text file that is no image."""
    root = write_image_folder(tmp_path_factory.mktemp("images"), "varied", 4, 150, 20)
    rng = np.random.default_rng(1)
    photo(rng, (90, 60), (210, 60, 50)).convert("L").save(root / "train/class0/grey.jpg")
    photo(rng, (70, 120), (60, 170, 70)).convert("CMYK").save(root / "train/class1/cmyk.jpg")
    photo(rng, (64, 64), (50, 80, 200)).save(root / "train/class2/drawing.png")
    photo(rng, (100, 80), (200, 180, 40)).save(root / "val/class3/photo.webp")
    (root / "train/class0/notes.txt").write_text("not an image")
    return root


def test_every_format_loads_as_rgb_of_the_size_asked(folder):
    """Greyscale and CMYK JPEGs, PNG and WebP as 3 uint8 channels; the text file left out."""
    train = images.ImageFiles(folder / "train", 24, seed=0, augment=True)
    val = images.ImageFiles(folder / "val", 24, seed=0, augment=False)
    assert (len(train), len(val)) == (603, 81)
    where = {
        Path(path).name: (split, i)
        for split in (train, val)
        for i, (path, _) in enumerate(split.samples)
    }
    for name in ("grey.jpg", "cmyk.jpg", "drawing.png", "photo.webp"):
        split, i = where[name]
        pixels, target = split[i]
        assert pixels.shape == (3, 24, 24) and pixels.dtype == torch.uint8, name
        assert target == split.targets[i]
    assert "notes.txt" not in where
    grey = train[where["grey.jpg"][1]][0]
    assert torch.equal(grey[0], grey[1]) and torch.equal(grey[1], grey[2])


def test_crops_and_flips_come_from_seed_epoch_and_index_alone(folder):
    """The same image, epoch and seed: the same pixels, in whichever process or worker; another
    epoch or seed: other crops."""
    train = images.ImageFiles(folder / "train", 24, seed=0, augment=True)
    first = torch.stack([train[i][0] for i in range(0, 600, 30)])
    train.set_epoch(1)
    second = torch.stack([train[i][0] for i in range(0, 600, 30)])
    train.set_epoch(0)
    again = torch.stack([train[i][0] for i in range(0, 600, 30)])
    other = images.ImageFiles(folder / "train", 24, seed=1, augment=True)
    other_seed = torch.stack([other[i][0] for i in range(0, 600, 30)])
    assert torch.equal(first, again)
    differ = lambda a, b: sum(not torch.equal(x, y) for x, y in zip(a, b))  # noqa: E731
    assert differ(first, second) == differ(first, other_seed) == 20
    # the DataLoader's workers read the epoch set after they started
    loader = torch.utils.data.DataLoader(
        train,
        10,
        sampler=range(0, 600, 30),
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context="forkserver",
    )
    assert torch.equal(torch.cat([x for x, _ in loader]), first)
    train.set_epoch(1)
    assert torch.equal(torch.cat([x for x, _ in loader]), second)


def test_the_crops_follow_torchvisions_recipe(folder):
    """RandomResizedCrop's boxes (scale 0.08 to 1, ratio 3/4 to 4/3), a flip in about half; the
    pixels of a box decoded at reduced size equal torchvision's resized_crop of the whole image
    but for the rounding of its decoding (a mean difference under 3 of 255)."""
    train = images.ImageFiles(folder / "train", 24, seed=0, augment=True)
    flips = 0
    for index in range(600):
        (left, top, right, bottom), flip = train.random_crop((160, 90), index)
        area = (right - left) * (bottom - top) / (160 * 90)
        ratio = (right - left) / (bottom - top)
        assert 0 <= left < right <= 160 and 0 <= top < bottom <= 90
        assert 0.07 <= area <= 1.01 and 0.7 <= ratio <= 1.4
        flips += flip
    assert 240 < flips < 360
    # a 1600 x 1200 photo, its crops decoded at 1/2 to 1/8 of its size
    path = folder / "large.jpg"
    photo(np.random.default_rng(2), (1600, 1200), (60, 170, 70)).save(path, quality=90)
    whole = TF.pil_to_tensor(Image.open(path).convert("RGB"))
    for box in [(0, 0, 1600, 1200), (100, 300, 900, 900), (1000, 50, 1300, 450)]:
        left, top, right, bottom = box
        with Image.open(path) as image:
            ours = images.decode_crop(image, box, 64)
            assert image.size != (1600, 1200)  # decoded smaller
        textbook = TF.resized_crop(whole, top, left, bottom - top, right - left, [64, 64])
        assert (ours.float() - textbook.float()).abs().mean() < 3, box
    # validation: Resize(64 * 256 / 224 = 73) makes the photo's 1200 rows 73, CenterCrop(64) keeps
    # 64 of them: a centred square of 64 * 1200 / 73 = 1052.05 of the photo's pixels
    box = images.center_crop((1600, 1200), 64)
    assert box == pytest.approx((273.97, 73.97, 1326.03, 1126.03), abs=0.01)
    with Image.open(path) as image:
        ours = images.decode_crop(image, box, 64)
    textbook = TF.resized_crop(whole, 74, 274, 1052, 1052, [64, 64])
    assert (ours.float() - textbook.float()).abs().mean() < 3


def test_two_processes_with_workers_train_what_one_without_does_and_a_killed_run_continues(
    folder, tmp_path
):
    """2 processes x 2 DataLoader workers == 1 process with none, to 1e-5 (GroupNorm: no batch
    statistics). One process with 2 workers, killed in its second epoch and run again, ends
    where it would have: its workers draw the crops of the epoch it continues."""
    flags = [*EXACT, "--data-dir", folder]
    one, two, killed = tmp_path / "one", tmp_path / "two", tmp_path / "killed"
    killed_run = python(
        "distributed.py", *flags, "--workers", "2", "--save-every", "1", "--output-dir", killed
    )
    proc, marker = start(killed_run)

    def in_second_epoch() -> bool:
        checkpoint = killed / "checkpoint.pt"
        if not checkpoint.exists():
            return False
        state = torch.load(checkpoint, weights_only=True)
        return state["epoch"] == 1 and state["step"] > 0

    wait_for(in_second_epoch, 120, "a checkpoint in the second epoch")
    proc.kill()
    finish(proc, marker, timeout=60)
    step = torch.load(killed / "checkpoint.pt", weights_only=True)["step"]
    assert 0 < step < 18, f"killed at step {step} of 18: not in the middle of the epoch"
    results = run_parallel(
        [
            (python("distributed.py", *flags, "--workers", "0", "--output-dir", one), {}),
            (torchrun(2, "distributed.py", *flags, "--workers", "2", "--output-dir", two), {}),
            (killed_run, {}),
        ]
    )
    assert f"1 of 3 epochs done and {step} steps of the next" in results[2].stdout
    assert max_weight_difference(one, two) <= 1e-5
    assert max_weight_difference(one, killed) <= 1e-5
    last = metrics(two)[-1]
    assert last["val_images"] == 81 and last["val_acc"] >= 0.9, last


def test_the_readme_main_job_learns_on_an_image_folder(folder, tmp_path):
    """The README's first command with --dataset imagefolder in place of fake data."""
    main_job = readme_main_job(tmp_path / "out")
    i = main_job.index("--dataset")
    main_job[i : i + 4] = ["--dataset", "imagefolder", "--data-dir", str(folder)]
    assert "--fake-size" not in main_job
    run(main_job)
    assert metrics(tmp_path / "out")[-1]["val_acc"] >= 0.9


def truncated(root: Path) -> Path:
    """Cut in the middle of its pixels, as an interrupted download."""
    path = root / "train/class1/3.jpg"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def not_an_image(root: Path) -> Path:
    path = root / "train/class0/5.jpg"
    path.write_text("a text file named as a JPEG")
    return path


def empty_class(root: Path) -> Path:
    path = root / "train/class1"
    for image in path.iterdir():
        image.unlink()
    return path


BAD_FILES = {
    "truncated": (truncated, "cannot read {} (image file is truncated"),
    "not an image": (not_an_image, "cannot read {} (cannot identify image file"),
    "empty class folder": (empty_class, "{} holds no images (.jpg, .jpeg, .png"),
}


def run_two_ranks(root: Path, out: Path, workers: str):
    """The tiny job on root, 2 processes of batch 4, one epoch's worth of steps before failing."""
    flags = [*EXACT, "--batch-size", "8", "--workers", workers, "--data-dir", root]
    return run(torchrun(2, "distributed.py", *flags, "--output-dir", out), check=False)


@pytest.mark.parametrize("case", BAD_FILES)
def test_a_file_that_cannot_be_read_ends_every_rank_naming_it(case, tmp_path):
    """A truncated JPEG and a text file named .jpg (read by a DataLoader worker of one rank), an
    empty class folder: every rank ends with the same line, naming it."""
    root = write_image_folder(tmp_path / "images", "varied", 2, 16, 4)
    bad, line = BAD_FILES[case]
    line = "error: " + line.format(bad(root))
    ends_every_rank_with(run_two_ranks(root, tmp_path / "out", "1"), line)


def test_a_bad_validation_file_ends_every_rank_naming_it(tmp_path):
    """Read by one rank only (validation shares are apart): the others learn of it when the
    sums are added up, and all end with its line."""
    root = write_image_folder(tmp_path / "images", "varied", 2, 16, 4)
    path = truncated(root).rename(root / "val/class0/1.jpg")
    result = run_two_ranks(root, tmp_path / "out", "0")
    ends_every_rank_with(result, f"error: cannot read {path} (image file is truncated")


def test_a_data_loader_workers_usage_error_is_its_own_line():
    """What PyTorch re-raises in the main process for a worker's UsageError reads as the line."""
    wrapped = utils.UsageError(
        "Caught UsageError in DataLoader worker process 0.\nOriginal Traceback (most recent call "
        'last):\n  File "builtin.py", line 1, in __getitem__\nutils.UsageError: cannot read x.jpg'
        " (broken data stream): remove or replace it\n"
    )
    assert str(wrapped) == "cannot read x.jpg (broken data stream): remove or replace it"
    assert str(utils.UsageError("plain")) == "plain"


def test_a_generated_folder_is_the_same_for_the_same_seed(tmp_path):
    a = write_image_folder(tmp_path / "a", "imagenet", 2, 2, 1, seed=5)
    b = write_image_folder(tmp_path / "b", "imagenet", 2, 2, 1, seed=5)
    files = sorted(p.relative_to(a) for p in a.rglob("*.jpg"))
    assert len(files) == 6
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    sizes = [Image.open(a / f).size for f in files]
    assert all(400 <= w <= 600 and 300 <= h <= 450 for w, h in sizes)
