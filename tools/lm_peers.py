"""What a user would run instead of the scripts to train a language model, for the benchmark (tools/benchmark.py --lm)
to measure them against, on the same workload (tools/lm_workload.py), global batch, recipe (AdamW, weight decay
0.01, a linear warm-up then a cosine decay) and precision:

- textbook: the plain DDP loop of the tutorials (DistributedSampler, DDP, AdamW, autocast, loss.item() every step);
- trainer: Hugging Face's Trainer;
- accelerate: Accelerate's Accelerator around the same loop.

    torchrun --standalone --nproc_per_node=2 tools/lm_peers.py --peer trainer --output-dir out

Each writes OUTPUT_DIR/epochs.json: every epoch's seconds, sequences/s, mean training loss and peak memory (MB, the
process's resident set on a CPU, the GPU's peak allocation on a GPU), from rank 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lm_workload import Sequences, gpt2, next_token_loss


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--peer", choices=["textbook", "trainer", "accelerate"], required=True, help="which loop"
    )
    parser.add_argument("--size", type=int, default=1024, help="sequences an epoch (default: 1024)")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch (default: 32)")
    parser.add_argument(
        "--epochs", type=int, default=3, help="epochs; the first is warm-up (default: 3)"
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW's peak lr (default: 1e-3)")
    parser.add_argument(
        "--warmup", type=float, default=0.05, help="warm-up part of the steps (default: 0.05)"
    )
    parser.add_argument(
        "--amp-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="autocast dtype (default: float32)",
    )
    parser.add_argument("--output-dir", type=Path, required=True, help="where epochs.json goes")
    return parser.parse_args()


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def warmup_cosine(step: int, steps: int, warmup: float) -> float:
    """The lr factor at a step: a linear rise over the warm-up, then a cosine decay to 0."""
    rise = max(1, round(warmup * steps))
    if step < rise:
        return (step + 1) / rise
    return 0.5 * (1 + math.cos(math.pi * (step - rise) / max(1, steps - rise)))


class Epochs:
    """Each epoch's seconds, sequences/s, mean training loss and peak memory, written by rank 0."""

    def __init__(self, args, device: torch.device):
        self.args, self.device, self.rows = args, device, []

    def begin(self) -> None:
        self.began, self.losses = time.perf_counter(), []

    def end(self) -> None:
        seconds = time.perf_counter() - self.began
        self.rows.append(
            dict(
                epoch_time_s=seconds,
                samples_per_s=self.args.size
                // self.args.batch_size
                * self.args.batch_size
                / seconds,
                train_loss=sum(self.losses) / max(1, len(self.losses)),
                peak_mem_mb=peak_memory_mb(self.device),
            )
        )
        if int(os.environ.get("RANK", 0)) == 0:
            self.args.output_dir.mkdir(parents=True, exist_ok=True)
            (self.args.output_dir / "epochs.json").write_text(json.dumps(self.rows))


def textbook(args, device: torch.device, dtype: torch.dtype) -> None:
    """The tutorials' loop: a DistributedSampler, DDP, AdamW, autocast, the loss read every step."""
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    model = torch.nn.parallel.DistributedDataParallel(
        gpt2().to(device), device_ids=[device.index] if device.type == "cuda" else None
    )
    data = Sequences(args.size, 1)
    sampler = torch.utils.data.DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    loader = torch.utils.data.DataLoader(
        data, batch_size=args.batch_size // dist.get_world_size(), sampler=sampler, drop_last=True
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    steps = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, steps, args.warmup)
    )
    epochs = Epochs(args, device)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        epochs.begin()
        for ids in loader:
            ids = ids.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                total, count = next_token_loss(model(input_ids=ids).logits, ids)
            loss = total / count
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            epochs.losses.append(loss.item())
        epochs.end()
    dist.destroy_process_group()


def accelerate(args, device: torch.device, dtype: torch.dtype) -> None:
    """The same loop under Accelerate: it wraps the model in DDP, shards the loader and runs autocast."""
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="bf16" if dtype == torch.bfloat16 else "no")
    loader = torch.utils.data.DataLoader(
        Sequences(args.size, 1),
        batch_size=args.batch_size // accelerator.num_processes,
        shuffle=True,
        drop_last=True,
    )
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, steps, args.warmup)
    )
    epochs = Epochs(args, accelerator.device)
    for _ in range(args.epochs):
        epochs.begin()
        for ids in loader:
            total, count = next_token_loss(model(input_ids=ids).logits, ids)
            loss = total / count
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            epochs.losses.append(loss.item())
        epochs.end()
    accelerator.end_training()


def trainer(args, device: torch.device, dtype: torch.dtype) -> None:
    """Hugging Face's Trainer: its labels are the inputs (it shifts them itself), its own loop and DDP."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    epochs = Epochs(args, device)

    class Timed(TrainerCallback):
        def on_epoch_begin(self, *_, **__):
            epochs.begin()

        def on_epoch_end(self, *_, **__):
            epochs.end()

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "loss" in logs:
                epochs.losses.append(logs["loss"])

    training = TrainingArguments(
        output_dir=str(args.output_dir / "trainer"),
        per_device_train_batch_size=args.batch_size // int(os.environ.get("WORLD_SIZE", 1)),
        num_train_epochs=args.epochs,
        learning_rate=args.lr,
        weight_decay=0.01,
        warmup_steps=max(1, round(args.warmup * args.epochs * (args.size // args.batch_size))),
        lr_scheduler_type="cosine",
        optim="adamw_torch",
        bf16=dtype == torch.bfloat16,
        use_cpu=device.type == "cpu",
        dataloader_drop_last=True,
        logging_steps=1,  # the loss every step, as the other loops read it
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        ddp_backend="gloo" if device.type == "cpu" else None,
    )

    def collate(samples):
        ids = torch.stack(samples)
        return {"input_ids": ids, "labels": ids}

    Trainer(
        model=gpt2(),
        args=training,
        train_dataset=Sequences(args.size, 1),
        data_collator=collate,
        callbacks=[Timed()],
    ).train()


def main() -> None:
    args = parse_args()
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    dtype = getattr(torch, args.amp_dtype)
    {"textbook": textbook, "trainer": trainer, "accelerate": accelerate}[args.peer](
        args, device, dtype
    )


if __name__ == "__main__":
    main()
