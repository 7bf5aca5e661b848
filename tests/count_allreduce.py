"""Run one epoch of distributed_grad_accum.train_one_epoch with a DDP communication
hook that counts gradient all-reduces; rank 0 prints the counts as JSON.

    torchrun --nproc_per_node=2 tests/count_allreduce.py --accum-steps 4 ...
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import distributed_grad_accum as script  # noqa: E402
import torch  # noqa: E402
import utils  # noqa: E402
from extras import checkpoints, metrics, stalls  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


def main(teardown):
    args = script.parse_args()
    rank, local_rank, world_size, device = script.setup_distributed(args)
    train_set, val_set, num_classes = script.build_datasets(args)
    micro_batch = args.batch_size // (world_size * args.accum_steps)
    loader, val_loader = script.build_loaders(
        train_set, val_set, micro_batch, args, rank, world_size, device
    )
    model = DDP(script.build_model(args, num_classes))
    all_reduces, optimizer_steps = [], []

    def counting_hook(state, bucket):
        if bucket.is_last():  # one all-reduce round covers every bucket once
            all_reduces.append(bucket.index())
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    optimizer.register_step_post_hook(lambda *_: optimizer_steps.append(1))
    scheduler = utils.warmup_cosine(optimizer, len(loader) // args.accum_steps, args.warmup)
    run = script.Training(
        args=args,
        model=model,
        frozen={},
        optimizer=optimizer,
        scheduler=scheduler,
        ema=None,
        train_loader=loader,
        val_loader=val_loader,
        device=device,
        stop=utils.StopSignal(),
        watchdog=teardown.enter_context(stalls.Watchdog(args.timeout, Path(args.output_dir), rank)),
        recorder=metrics.StepRecords(
            Path(args.output_dir), args, rank, len(loader) // args.accum_steps
        ),
        val_metrics=None,
        saves=teardown.enter_context(checkpoints.Saves()),
    )
    script.train_one_epoch(run, 0, 0)
    if rank == 0:
        print(
            json.dumps(
                {
                    "micro_batches": len(loader),
                    "all_reduces": len(all_reduces),
                    "optimizer_steps": len(optimizer_steps),
                }
            )
        )


if __name__ == "__main__":
    utils.run_main(main)
