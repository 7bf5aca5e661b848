"""Host memory per rank and phase of a GPT-2 trained on 2 CPU processes: each approach's run is the scripts as a user
runs them, with the user's code noting the resident memory of its process every 50 ms and the phase it is in. GPT-2
large needs the machine's memory and minutes, so it runs by hand; tests/test_fsdp.py runs FSDP on GPT-2 small.

    python tools/fsdp_memory.py                                    # GPT-2 small: DDP, FSDP, FSDP + checkpointing
    python tools/fsdp_memory.py --model gpt2-large --only FSDP     # 774M parameters: what DDP cannot hold here
    python tools/fsdp_memory.py --gpu --batch-size 8 --tokens 1024  # 1 process per GPU, + FSDP with --cpu-offload
    python tools/fsdp_memory.py --model gpt2-large --beyond-the-state  # what a rank holds beside its shards

Each approach runs twice: 1 epoch of 2 steps (of 2 planned epochs), then the same command again, which continues
from the checkpoint and trains the second. Phases of the first run: build (build_model), shard (FSDP's sharding and
the weights sent from rank 0; DDP's wrap), start-up (the start-up check's step), training (the optimizer steps),
validation, save (from validation's last loss: the checkpoint, model.pt, hf/); continuation: the whole second run.
Prints, per approach and rank, the peak resident memory of each phase in GiB, what the save adds to the memory it
began with, the state the rank holds (metrics.jsonl's, rank 0's), the job's peak (both ranks' resident memory at
the same moment, summed), and the start-up line that says what each rank will hold. With --gpu, one process per
GPU, and the GPU's peak (allocated, the largest of metrics.jsonl's peak_mem_mb) in a column of its own.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from processes import metrics, run  # noqa: E402
from projects import copy_with_your_functions, launch  # noqa: E402

# the user's code: random tokens, a GPT-2 from its config, the token loss; the memory noted by a thread per process
MEASURED = '''
import json
import os
import threading
import time

from transformers import GPT2Config, GPT2LMHeadModel

PHASE = ["build"]


def note_memory():
    """Every 50 ms: seconds, the phase, resident MiB, into $MEMORY/RANK (a line each, so a kill loses none)."""
    path, page = os.path.join(os.environ["MEMORY"], os.environ.get("RANK", "0")), os.sysconf("SC_PAGE_SIZE")
    with open(path, "a", buffering=1) as f:
        while True:
            with open("/proc/self/statm") as statm:
                f.write(f"{time.time():.2f} {PHASE[0]} {int(statm.read().split()[1]) * page / 2**20:.0f}\\n")
            time.sleep(0.05)


def build_datasets(args):
    threading.Thread(target=note_memory, daemon=True).start()
    tokens = int(os.environ["TOKENS"])
    ids = list(torch.randint(0, 50257, (args.batch_size * 3, tokens), generator=torch.Generator().manual_seed(0)))
    return [(x, x) for x in ids[:args.batch_size * 2]], [(x, x) for x in ids[args.batch_size * 2:]], 50257


def build_model(args, num_classes):
    model = GPT2LMHeadModel(GPT2Config.from_dict(json.loads(os.environ["GPT2_CONFIG"])))
    model.register_forward_pre_hook(lambda module, inputs: None if torch.is_grad_enabled() else PHASE.__setitem__(
        0, "validation"))
    PHASE[0] = "shard"
    return model


CALLS = [0]


def collate(samples):  # the start-up check collates twice; then each training batch
    CALLS[0] += 1
    PHASE[0] = "start-up" if CALLS[0] <= 2 else "training"
    return torch.utils.data.default_collate(samples)


def compute_loss(outputs, targets):
    if not torch.is_grad_enabled():  # a validation forward is done: the saves follow the last one
        PHASE[0] = "save"
    logits, labels = outputs.logits[:, :-1], targets[:, 1:]
    return F.cross_entropy(logits.transpose(1, 2), labels, reduction="sum"), labels.numel()
'''

CONFIGS = {"gpt2": {}, "gpt2-large": {"n_embd": 1280, "n_layer": 36, "n_head": 20}}
APPROACHES = {
    "DDP": ("distributed.py", []),
    "FSDP": ("distributed_fsdp.py", []),
    "FSDP + activation checkpointing": ("distributed_fsdp.py", ["--activation-checkpointing"]),
}
ON_GPUS = {
    "FSDP + CPU offload": ("distributed_fsdp.py", ["--cpu-offload"])
}  # on CPU processes it changes nothing
PHASES = ["build", "shard", "start-up", "training", "validation", "save", "continuation"]


def notes(directory: Path, rank: int) -> list[tuple[float, str, float]]:
    """A rank's notes of both runs, (seconds, phase, GiB), the second run's phase named continuation."""
    found = []
    for run_dir, second in ((directory / "1", False), (directory / "2", True)):
        for line in (run_dir / str(rank)).read_text().splitlines():
            seconds, phase, mib = line.split()
            found.append((float(seconds), "continuation" if second else phase, float(mib) / 1024))
    return found


def peaks(found: list[tuple[float, str, float]]) -> dict[str, float]:
    """The largest resident memory, GiB, of each phase."""
    highest: dict[str, float] = {}
    for _, phase, gib in found:
        highest[phase] = max(highest.get(phase, 0.0), gib)
    return highest


def job_peak(ranks: list[list[tuple[float, str, float]]]) -> float:
    """The largest sum of every rank's latest note, GiB: the job's resident memory at one moment."""
    latest, highest = [0.0] * len(ranks), 0.0
    for seconds, rank, gib in sorted(
        (s, r, g) for r, found in enumerate(ranks) for s, _, g in found
    ):
        latest[rank] = gib
        highest = max(highest, sum(latest))
    return highest


def beyond_the_state(config: dict, batch_per_rank: int, tokens: int) -> None:
    """What a rank's training holds beside its shards, from the model's sizes: the activations one forward saves for
    backward (counted by autograd's hooks, weights left out), and the units that FSDP gathers whole."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config.from_dict(config))
    weights, saved = {p.untyped_storage().data_ptr() for p in model.parameters()}, {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if (storage := tensor.untyped_storage()).data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(0, model.config.vocab_size, (batch_per_rank, tokens))
    with torch.autograd.graph.saved_tensors_hooks(
        pack, lambda tensor: tensor
    ):  # the forward and the loss
        torch.nn.functional.cross_entropy(model(ids).logits[:, :-1].transpose(1, 2), ids[:, 1:])
    mib = {name: p.numel() * p.element_size() / 2**20 for name, p in model.named_parameters()}
    block = sum(size for name, size in mib.items() if name.startswith("transformer.h.0."))
    root = sum(size for name, size in mib.items() if not name.startswith("transformer.h."))
    print(
        f"beyond the state, each rank ({batch_per_rank} sequences of {tokens} tokens): activations saved for "
        f"backward {sum(saved.values()) / 2**20:.0f} MiB; the root unit (embeddings, tied head, final norm) "
        f"{root:.0f} MiB gathered and as much of unsharded gradient through backward; a block {block:.0f} MiB, "
        f"gathered with the next one prefetched, and its gradient before the reduce-scatter"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", choices=list(CONFIGS), default="gpt2", help="the GPT-2 built from its config"
    )
    parser.add_argument("--only", default=None, help="this approach alone: DDP, FSDP, ...")
    parser.add_argument("--batch-size", type=int, default=4, help="global batch of sequences")
    parser.add_argument("--tokens", type=int, default=32, help="tokens a sequence")
    parser.add_argument(
        "--gpu", action="store_true", help="one process per GPU (not 2 CPU processes), + offload"
    )
    parser.add_argument(
        "--beyond-the-state",
        action="store_true",
        help="only print what a rank's training holds beside its shards (no run)",
    )
    args = parser.parse_args()
    config, nproc = json.dumps(CONFIGS[args.model]), torch.cuda.device_count() if args.gpu else 2
    if args.beyond_the_state:
        return beyond_the_state(CONFIGS[args.model], args.batch_size // nproc, args.tokens)
    flags = [
        "--batch-size",
        str(args.batch_size),
        "--epochs",
        "2",
        "--workers",
        "0",
        "--optimizer",
        "adamw",
        "--timeout",
        "600",
        "--print-freq",
        "1",
        "--steps-per-epoch",
        "2",
    ]
    where = f"{nproc} x {torch.cuda.get_device_name(0)}" if args.gpu else "2 CPU processes"
    print(
        f"{args.model}, {where}, AdamW, batch {args.batch_size} of {args.tokens} tokens, epochs of 2 steps"
    )
    gpu = " GPU peak |" if args.gpu else ""
    print(
        "| approach | rank | "
        + " | ".join(PHASES)
        + f" | save adds | state held | job |{gpu} s/step |"
    )
    print(
        "| --- | ---: | "
        + " | ".join(["---:"] * len(PHASES))
        + " | ---: | ---: | ---: |"
        + " ---: |" * (1 + args.gpu)
    )
    for name, (script, extra) in {**APPROACHES, **(ON_GPUS if args.gpu else {})}.items():
        if args.only and args.only != name:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            copy, said = copy_with_your_functions(script, Path(tmp) / "copy", MEASURED), set()
            for second in (
                "1",
                "2",
            ):  # the first run stops after its epoch; the same command continues
                (Path(tmp) / "memory" / second).mkdir(parents=True)
                stop = ["--stop-after", "1"] if second == "1" else []
                threads = {} if args.gpu else {"OMP_NUM_THREADS": "1"}
                # glibc's mmap threshold fixed at 1 MiB, as docs/fsdp.md advises for a run that memory limits
                result = run(
                    launch(copy, nproc, *flags, *extra, *stop, "--output-dir", Path(tmp) / "out"),
                    timeout=3600,
                    cwd=Path(tmp),
                    env={
                        "MEMORY": str(Path(tmp) / "memory" / second),
                        "GPT2_CONFIG": config,
                        "TOKENS": str(args.tokens),
                        "MALLOC_MMAP_THRESHOLD_": str(2**20),
                        **threads,
                    },
                )
                # what each rank will hold, and a save written with the loop waiting (no room to copy it)
                said.update(
                    line
                    for line in result.stdout.splitlines()
                    if line.startswith("each rank will hold") or "before training goes on" in line
                )
            m = metrics(Path(tmp) / "out")[0]
            state = (m["params_mb"] + m["grads_mb"] + m["optimizer_mb"]) / 1024
            gpu_peak = (
                f" {max(e['peak_mem_mb'] for e in metrics(Path(tmp) / 'out')) / 1024:.2f} |"
                if args.gpu
                else ""
            )
            found = [notes(Path(tmp) / "memory", rank) for rank in range(nproc)]
            for rank in range(nproc):
                highest = peaks(found[rank])
                cells = " | ".join(f"{highest[p]:.2f}" if p in highest else "-" for p in PHASES)
                save = [gib for _, phase, gib in found[rank] if phase == "save"]
                print(
                    f"| {name} | {rank} | {cells} | {max(save) - save[0]:.2f} | {state:.2f} | "
                    f"{job_peak(found):.2f} |{gpu_peak} {m['epoch_time_s'] / 2:.2f} |",
                    flush=True,
                )
            if said:  # FSDP's start-up line: what each rank will hold
                print(f"{name}: " + "; ".join(sorted(said)))


if __name__ == "__main__":
    main()
