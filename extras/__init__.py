"""The extras: every guarantee beyond the core (utils.py), a module each, which a script imports
where it uses it. Importing one changes nothing of the process (no environment variable, no
warnings filter). In the order a reader of distributed.py meets them:

- slurm: srun without torchrun, the ranks and the rendezvous address from Slurm's variables;
- elastic: a process group under torchrun, met in a part of its store no earlier group wrote to
  (its workers restarted, nodes that join);
- stalls: the watchdog that ends a stalled run, naming the rank, its step and its line;
- workers: how DataLoader workers start (a forkserver) and what they leave to their rank;
- live: a terminal's live line on rank 0 (the step of steps, the time left), rewritten in place;
- seeds: where a sample's random draws come from: its transforms from (seed, epoch, index), never
  from which rank or worker draws (dropout's, from (seed, rank, epoch, step), are the core's);
- samplers: a project's own sampler (build_sampler) drawn whole on every rank from (seed, epoch)
  as one process draws it, each rank its share of every global batch; validation's shares;
- streams: a stream (an IterableDataset) read as global batches, each sample once;
- batches: a loss over the whole global batch (whole_batch), exact on any number of processes;
- gradcache: accumulation's step for a loss over the whole batch (GradCache's), all of a step's
  micro-batches' outputs at once;
- checks: one line before training for what would fail (the start-up step);
- batch_norm: --sync-bn on CPU processes, batch-norm statistics of the global batch over gloo;
- together: models trained together (a GAN's), each its own DDP, optimizer and schedule;
- averages: --ema, the moving average of the weights, validated and saved beside them;
- metrics: the sums of an epoch (Meter) and steps.jsonl's records (StepRecords), the best
  validation so far (--keep-best);
- scores: a project's own validation metrics (build_metrics, torchmetrics') over every
  validation sample once;
- peaks: the GPUs' dense peak TFLOP/s that an epoch's MFU is measured against;
- profiles: where a step's time goes (--phases): its phases on every rank, the slow rank named,
  and --profile A:B, torch.profiler over those steps, a trace a rank;
- sinks: TensorBoard and Weights & Biases, fed the same records;
- curves: the run's picture, curves.svg beside steps.jsonl, drawn by rank 0 at each validation;
- checkpoints: files written whole (in the background: Saves; FSDP's shards too), checkpoints
  read by rank 0 and sent to all, restore, a tied parameter saved once;
- builtin: the demo data and models (--dataset, --arch), which a user's own functions replace;
- images: an image folder with torchvision's recipe, each JPEG decoded no larger than its crop.
"""
