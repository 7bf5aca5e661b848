"""What FSDP itself costs a step on CPU processes, without the scripts: the language-model benchmark's GPT-2
(tools/lm_workload.py) trained by a bare loop on 2 gloo processes of one thread each, wrapped in DDP and in FSDP2
(fully_shard on each block and the root), fused AdamW, one batch of 16 sequences a rank kept in memory; each
wrapper's median step, and, for FSDP, the milliseconds a step that torch.profiler puts in its all-gathers and
reduce-scatters (rank 0). Set beside the benchmark's FSDP and DDP rows, it says how much of their gap is FSDP's.

    python tools/fsdp_cpu_cost.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import lm_workload  # noqa: E402
from processes import free_port  # noqa: E402

STEPS = 30


def rank_main(rank: int, wrapper: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)  # as torchrun sets OMP_NUM_THREADS for each of its processes
    torch.manual_seed(0)
    model = lm_workload.gpt2()
    if wrapper == "FSDP":
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    ids = lm_workload.Sequences(16, rank).ids
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def step() -> None:
        total, count = lm_workload.next_token_loss(model(input_ids=ids).logits, ids)
        (total / count).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = []
    for i in range(5 + STEPS):  # 5 to warm up
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    collectives = "-"
    if wrapper == "FSDP":  # the CPU's profiler alone
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            for _ in range(5):
                step()
        spent = sum(
            e.self_cpu_time_total
            for e in profiler.key_averages()
            if e.key.startswith(("FSDP::all_gather", "FSDP::post_backward_reduce"))
        )
        collectives = f"{spent / 5 / 1e3:.1f}"
    if rank == 0:
        median = statistics.median(times[5:]) * 1e3
        print(f"| {wrapper} | {median:.1f} | {collectives} |", flush=True)
    dist.destroy_process_group()


def main() -> None:
    print("| wrapper | ms a step (median) | FSDP's all-gathers and reduce-scatters, ms a step |")
    print("| --- | ---: | ---: |")
    for wrapper in ("DDP", "FSDP"):
        mp.spawn(rank_main, (wrapper, free_port()), nprocs=2)
    s = lm_workload.size()
    print(
        f"\nGPT-2 of {s['LM_LAYERS']} layers, width {s['LM_WIDTH']}, {s['LM_LENGTH']} tokens; 2 gloo processes"
        f" of one thread, 16 sequences each; {STEPS} steps, PyTorch {torch.__version__}."
    )


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help alone
    main()
