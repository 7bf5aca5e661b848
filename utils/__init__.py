"""What every training script needs and no approach owns, a module a concern. Each script holds
its recipe (sampler, loaders, wrap, step, evaluation) and imports these by name; a module imports
the folder's others relatively, so the folder works under any name (ddp_utils/ beside a project's
own utils). In the order a reader of distributed.py meets them:

- errors: UsageError, and run_main, which ends every error of ours or a library's in one line;
- flags: the flags every script shares (build_parser, check_args), DDP's own (add_ddp_flags);
- ranks: joining the process group, collectives in a world of one too, which ranks print, the
  host memory a node's ranks share, errors_shared_by_all_ranks, models trained together (Wrapped);
- stalls: the watchdog that ends a stalled run, naming the rank, its step and its line;
- workers: how DataLoader workers start (a forkserver) and what they leave to their rank;
- seeds: where each random draw comes from: a sample's transforms from (seed, epoch, index),
  dropout from (seed, rank, epoch, step), never from which rank or worker draws;
- samplers: a project's own sampler (build_sampler) drawn whole on every rank from (seed, epoch)
  as one process draws it, each rank its share of every global batch; validation's shares;
- streams: a stream (an IterableDataset) read as global batches, each sample once;
- batches: any batch of any task: counted, moved to the device, forwarded, its loss; a loss
  over the whole global batch (whole_batch), over a step's micro-batches (Joined);
- checks: one line before training for what would fail (the start-up step);
- batch_norm: --sync-bn on CPU processes, batch-norm statistics of the global batch over gloo;
- optimizers: the optimizer, the warm-up and cosine schedule, the moving average of weights;
- stops: the step every rank stops after (a signal, a stream that ended, a failed write);
- loops: what happens around each training step, whatever the step does (EpochSteps);
- metrics: the sums of an epoch (Meter) and steps.jsonl's records (StepRecords), the best
  validation so far (--keep-best);
- scores: a project's own validation metrics (build_metrics, torchmetrics') over every
  validation sample once;
- peaks: the GPUs' dense peak TFLOP/s that an epoch's MFU is measured against;
- profiles: where a step's time goes: its phases on every rank, the slow rank named, and
  --profile A:B, torch.profiler over those steps, a trace a rank;
- sinks: TensorBoard and Weights & Biases, fed the same records;
- checkpoints: files written whole (in the background: Saves; FSDP's shards too), checkpoints
  read by rank 0 and sent to all, restore, a tied parameter saved once;
- internals: every private name of PyTorch the folder reaches, in one place;
- builtin: the demo data and models (--dataset, --arch), which a user's own functions replace;
- images: an image folder with torchvision's recipe, each JPEG decoded no larger than its crop.
"""

import os

# PyTorch's C++ side logs rendezvous retries with stack dumps; our errors say it in one line. Set
# before torch loads (the scripts import this folder first); TORCH_CPP_LOG_LEVEL=INFO shows all.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
# A rank that ends at once (an error, a stall) leaves its forkserver workers' named semaphores to
# the resource tracker, which frees them, and would warn about each run on stderr.
if "ignore:resource_tracker" not in os.environ.get("PYTHONWARNINGS", ""):
    os.environ["PYTHONWARNINGS"] = ",".join(
        filter(None, [os.environ.get("PYTHONWARNINGS"), "ignore:resource_tracker"])
    )
# NCCL's Flight Recorder keeps each rank's last collectives, for a stalled rank's stalls/ folder.
# It is read when a process group starts.
os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")

import torch  # noqa: E402

# PyTorch 2.8 or newer: on an older one a gloo process group could hang at exit (PyTorch PR
# 154976), and a listening socket failed the tcp:// store. 2.8.0a0 (a container's build) is 2.8.
if tuple(map(int, torch.__version__.split(".")[:2])) < (2, 8):
    raise SystemExit(
        f"error: the scripts need PyTorch 2.8 or newer, not {torch.__version__}: pip install -r"
        " requirements.txt"
    )
