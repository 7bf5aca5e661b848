"""The flags every script shares (docs/recipe-and-flags.md), read so that a bad flag ends in one
line; each script adds its approach's own flags in its parse_args (DDP's --sync-bn, --comm-hook,
--find-unused-parameters in the DDP scripts).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

import torch

from .errors import UsageError
from .profiles import steps_to_profile


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag ends in one line, and --flag_name is accepted for --flag-name."""

    def error(self, message: str) -> None:
        # run_main prints it as it prints every other error
        raise UsageError(f"{message} (see {self.prog} --help)")

    def parse_known_args(self, args=None, namespace=None):
        if args is None:
            args = sys.argv[1:]
        return super().parse_known_args([kebab_case(arg) for arg in args], namespace)


def kebab_case(arg: str) -> str:
    """--batch_size=1_000 -> --batch-size=1_000: the flag's name only, up to an "=", not the
    value."""
    match = re.match("--[^=]+", arg)
    if match is None:
        return arg
    return match[0].replace("_", "-") + arg[match.end() :]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, but for a default computed at run time (None), which the
    flag's help describes."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser(description: str, one_process: bool = False) -> ArgumentParser:
    """The flags every script shares (README.md, "Flags"); each script's parse_args adds its
    approach's own. one_process (dataparallel.py): the rendezvous flags say they go unused."""
    p = ArgumentParser(
        description=description,
        formatter_class=HelpFormatter,
        epilog="Every flag may also be spelt with underscores: --batch_size 128.",
    )
    add = p.add_argument
    add(
        "--dataset",
        default="cifar100",
        choices=["cifar10", "cifar100", "imagefolder", "fake"],
        help="built-in data",
    )
    add("--data-dir", default="./data", help="where data lives or is downloaded to")
    add("--no-download", action="store_true", help="fail instead of downloading missing CIFAR")
    add("--fake-size", type=int, default=50_000, help="training images of --dataset fake")
    add("--image-size", type=int, default=32, help="side of imagefolder and fake images")
    add(
        "--no-augment",
        action="store_true",
        help="no random crops or flips (exact reproducibility checks)",
    )
    add("--arch", default="resnet18", help="tiny, or a torchvision classifier name")
    add("--epochs", type=int, default=30, help="planned epochs (the lr schedule spans them)")
    add(
        "--steps-per-epoch",
        type=int,
        default=None,
        metavar="N",
        help="end each epoch after N optimizer steps; a stream without __len__ needs it (default:"
        " every full batch of the training set)",
    )
    add(
        "--stop-after",
        type=int,
        default=None,
        metavar="N",
        help="end after N epochs of this run, counted from where it starts (a continued run from"
        " its checkpoint); the same command continues (default: up to --epochs)",
    )
    add(
        "--batch-size",
        type=int,
        default=256,
        help="GLOBAL batch size, split over all processes into parts that differ by at most one"
        " sample",
    )
    add("--optimizer", choices=["sgd", "adamw"], default="sgd", help="SGD with momentum, or AdamW")
    add(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate (default: sgd 0.1 x batch-size / 256, adamw 1e-3)",
    )
    add(
        "--warmup",
        type=float,
        default=0.1,
        metavar="FRACTION",
        help="part of the steps the lr rises linearly",
    )
    add("--momentum", type=float, default=0.9, help="SGD momentum")
    add(
        "--weight-decay",
        type=float,
        default=None,
        help="weight decay (default: sgd 5e-4, adamw 0.01)",
    )
    add(
        "--clip-grad",
        type=float,
        default=None,
        metavar="NORM",
        help="clip the gradients' global norm to NORM (default: no clipping)",
    )
    add(
        "--workers",
        type=int,
        default=None,
        help="DataLoader workers per process (default: 0 on a CPU; with GPUs, the cores per GPU"
        " less 2, at most 8)",
    )
    add(
        "--seed",
        type=int,
        default=0,
        help="seed for init, data order, each sample's random transforms (from seed, epoch, index)"
        " and each rank's dropout (from seed, rank, step)",
    )
    add(
        "--print-freq",
        type=int,
        default=50,
        help="a progress line and a record in steps.jsonl every N steps",
    )
    add(
        "--eval-every",
        type=int,
        default=None,
        metavar="N",
        help="also validate every N steps (default: epoch ends)",
    )
    add(
        "--tensorboard",
        action="store_true",
        help="rank 0 also writes steps.jsonl's records to OUTPUT_DIR/tensorboard",
    )
    add(
        "--wandb",
        default=None,
        metavar="PROJECT",
        help="rank 0 also logs the records to a Weights & Biases run (default: off)",
    )
    add(
        "--ema",
        type=float,
        metavar="DECAY",
        help="also validate and save a moving average of the weights with this decay, e.g. 0.999"
        " (default: off)",
    )
    add(
        "--keep-best",
        default=None,
        metavar="NAME",
        help="also write the weights of the best validation so far by NAME to"
        " OUTPUT_DIR/model_best.pt: val_loss, val_acc, val_acc5, a val_<metric> of build_metrics,"
        " or one of these with _ema (default: off)",
    )
    add(
        "--keep-best-mode",
        choices=["min", "max"],
        default=None,
        help="with --keep-best: whether its best value is the lowest or the highest (default: min"
        " for a name with 'loss' in it, else max)",
    )
    # accepted by every script alike, so that one command line fits all; DataParallel joins no group
    unused = "; unused here: one process, no process group" if one_process else ""
    add(
        "--ip",
        default=None,
        help=f"rendezvous address for tcp:// init (default: 127.0.0.1{unused})",
    )
    add(
        "--port",
        type=int,
        default=None,
        help="rendezvous port for tcp:// init (default: 29500 where --ip is given, a free one for"
        " distributed_mp.py on one node; without either, torchrun's env:// or one process"
        f" alone{unused})",
    )
    add(
        "--dist-url",
        default=None,
        help="env://, tcp://HOST:PORT or file:///shared/path (overrides --ip/--port; default:"
        f" from --ip/--port, else env:// under torchrun{unused})",
    )
    add(
        "--backend",
        choices=["nccl", "gloo"],
        default=None,
        help=f"the collectives' library (default: nccl with CUDA, else gloo{unused})",
    )
    add(
        "--timeout",
        type=float,
        default=300,
        help=(
            "seconds a rank may make no progress (no batch, no byte saved) before every rank"
            " ends, naming it; before the first step, how long a rank may wait for another (the"
            " rendezvous, a collective); start-up work itself has no bound"
        ),
    )
    add(
        "--channels-last",
        action="store_true",
        help="NHWC model and images (faster on Tensor Cores; not with FSDP, which shards"
        " contiguous weights only)",
    )
    add(
        "--peak-tflops",
        type=float,
        default=None,
        metavar="T",
        help="a GPU's dense peak TFLOP/s at the run's precision, for the epoch's mfu (default: from"
        " a table of known GPUs; none on a CPU)",
    )
    add(
        "--profile",
        default=None,
        metavar="A:B",
        help="torch.profiler over optimizer steps A to B of the run (default: off), the step's"
        " phases marked: a"
        " Chrome trace a rank in OUTPUT_DIR/profile/",
    )
    add("--compile", action="store_true", help="compile the model with torch.compile")
    add(
        "--compile-mode",
        choices=["default", "reduce-overhead", "max-autotune"],
        help="torch.compile's mode; implies --compile (default: its own, 'default')",
    )
    add(
        "--output-dir",
        default="./output",
        help="where rank 0 writes checkpoint.pt (FSDP: every rank its shards of checkpoint/, and"
        " model.pt), metrics.jsonl and steps.jsonl",
    )
    add(
        "--save-every",
        type=int,
        default=None,
        metavar="N",
        help="also save a checkpoint every N optimizer steps (default: at epoch ends only)",
    )
    add(
        "--save-minutes",
        type=float,
        default=None,
        metavar="M",
        help="also save a checkpoint every M minutes of training (at a step all ranks agree on):"
        " a lost node costs at most that (default: off)",
    )
    return p


def add_ddp_flags(parser: ArgumentParser) -> None:
    """DDP's own flags, of the four DDP scripts."""
    parser.add_argument(
        "--sync-bn",
        action="store_true",
        help="batch-norm statistics over the global batch, all ranks' samples (PyTorch's"
        " SyncBatchNorm on GPUs; on CPU processes the same over gloo)",
    )
    parser.add_argument(
        "--find-unused-parameters",
        action="store_true",
        help="allow parameters without a gradient in some steps",
    )
    parser.add_argument(
        "--comm-hook",
        choices=["bf16"],
        default=None,
        help="all-reduce the gradients in bfloat16, half the bytes (PyTorch's bf16_compress_hook;"
        " default: float32 as they are)",
    )


def memory_format(args) -> torch.memory_format:
    """--channels-last: NHWC; otherwise the weights' own."""
    return torch.channels_last if args.channels_last else torch.preserve_format


def check_args(args: argparse.Namespace) -> argparse.Namespace:
    """Catch impossible values before any process group or data is touched; fill machine
    defaults. Returns args."""
    at_least_one = "epochs batch_size fake_size image_size print_freq eval_every stop_after"
    for name in f"{at_least_one} save_every steps_per_epoch".split():
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if (args.workers is not None and args.workers < 0) or args.seed < 0:
        raise UsageError("--workers and --seed must be >= 0")
    # not (value > 0): a NaN is refused too
    positive = (args.timeout, args.clip_grad, args.save_minutes, args.peak_tflops)
    if any(value is not None and not value > 0 for value in positive):
        raise UsageError("--timeout, --clip-grad, --save-minutes and --peak-tflops must be > 0")
    if any(value is not None and not value >= 0 for value in (args.lr, args.momentum)):
        raise UsageError("--lr and --momentum must be >= 0")
    if args.weight_decay is not None and not args.weight_decay >= 0:
        raise UsageError("--weight-decay must be >= 0")
    if args.port is not None and not 0 < args.port < 65536:
        raise UsageError(f"--port {args.port} is not a port: give 1 to 65535")
    if not 0 <= args.warmup < 1:
        raise UsageError("--warmup must be in [0, 1)")
    if args.ema is not None and not 0 <= args.ema < 1:
        message = "the average spans about 1 / (1 - DECAY) steps"
        raise UsageError(f"--ema {args.ema:g} is not in [0, 1): {message}")
    if args.backend == "nccl" and not torch.cuda.is_available():
        raise UsageError("--backend nccl needs GPUs, and none is visible: leave it out for gloo")
    if args.compile_mode is not None:
        args.compile = True
    if args.keep_best_mode is not None and args.keep_best is None:
        raise UsageError("--keep-best-mode needs --keep-best NAME, the validation figure it ranks")
    # --keep-best: lower is better for a loss (timm's rule), higher for the rest
    if args.keep_best_mode is None and args.keep_best is not None:
        args.keep_best_mode = "max"
        if "loss" in args.keep_best:
            args.keep_best_mode = "min"
    steps_to_profile(args.profile)  # a --profile that names no steps ends here
    # Optional packages are checked before any data or model is built.
    # torch.utils.tensorboard imports tensorboard.
    for flag, module in (("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb")):
        if getattr(args, flag):
            try:
                importlib.import_module(module)
            except ImportError:
                raise UsageError(f"--{flag} needs the {flag} package: pip install {flag}") from None
    # SGD follows the linear scaling rule (Goyal et al. 2017): 0.1 per 256 samples.
    if args.lr is None and args.optimizer == "adamw":
        args.lr = 1e-3
    elif args.lr is None:
        args.lr = 0.1 * args.batch_size / 256
    if args.weight_decay is None and args.optimizer == "adamw":
        args.weight_decay = 0.01
    elif args.weight_decay is None:
        args.weight_decay = 5e-4
    # Workers: the cores each GPU can spare, one kept for the training loop itself.
    if args.workers is None:
        gpus = torch.cuda.device_count()
        args.workers = 0
        if gpus:
            args.workers = min(8, max(0, (os.cpu_count() or 1) // gpus - 2))
    return args
