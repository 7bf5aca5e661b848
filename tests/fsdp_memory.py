"""Host memory per rank and phase of a GPT-2 trained on 2 CPU processes, by hand (it needs the machine's memory and
minutes, so it is not in CI): each approach's run is the scripts as a user runs them, with the user's code noting the
resident memory of its process every 50 ms and the phase it is in.

    python tests/fsdp_memory.py                                    # GPT-2 small: DDP, FSDP, FSDP + checkpointing
    python tests/fsdp_memory.py --model gpt2-large --only FSDP     # 774M parameters: what DDP cannot hold here

Phases: build (build_model), shard (FSDP's sharding and the weights sent from rank 0; DDP's wrap), start-up (the
start-up check's step), training (the optimizer steps), end (validation and the saves). Prints, per approach and rank, the peak
resident memory of each phase in GiB beside the state the rank holds (metrics.jsonl's, rank 0's).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from processes import metrics, run  # noqa: E402
from test_your_own_data import copy_with_your_functions, launch  # noqa: E402

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
    PHASE[0] = "shard"
    return model


CALLS = [0]


def collate(samples):  # the start-up check collates twice; then each training batch
    CALLS[0] += 1
    PHASE[0] = "start-up" if CALLS[0] <= 2 else "training" if PHASE[0] != "end" else "end"
    return torch.utils.data.default_collate(samples)


def compute_loss(outputs, targets):
    if not torch.is_grad_enabled():  # validation: the end of the run begins
        PHASE[0] = "end"
    logits, labels = outputs.logits[:, :-1], targets[:, 1:]
    return F.cross_entropy(logits.transpose(1, 2), labels, reduction="sum"), labels.numel()
'''

CONFIGS = {"gpt2": {}, "gpt2-large": {"n_embd": 1280, "n_layer": 36, "n_head": 20}}
APPROACHES = {"DDP": ("distributed.py", []), "FSDP": ("distributed_fsdp.py", []),
              "FSDP + activation checkpointing": ("distributed_fsdp.py", ["--activation-checkpointing"])}
PHASES = ["build", "shard", "start-up", "training", "end"]


def peaks(path: Path) -> dict[str, float]:
    """The largest resident memory, GiB, of each phase in a rank's notes."""
    found: dict[str, float] = {}
    for line in path.read_text().splitlines():
        _, phase, mib = line.split()
        found[phase] = max(found.get(phase, 0.0), float(mib) / 1024)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(CONFIGS), default="gpt2", help="the GPT-2 built from its config")
    parser.add_argument("--only", default=None, help="the approaches whose names contain this")
    parser.add_argument("--batch-size", type=int, default=4, help="global batch of sequences")
    parser.add_argument("--tokens", type=int, default=32, help="tokens a sequence")
    args = parser.parse_args()
    config = json.dumps(CONFIGS[args.model])
    flags = ["--batch-size", str(args.batch_size), "--epochs", "1", "--workers", "0", "--optimizer", "adamw",
             "--timeout", "600", "--print-freq", "1"]
    print(f"{args.model}, 2 CPU processes, AdamW, batch {args.batch_size} of {args.tokens} tokens, 2 steps")
    print("| approach | rank | " + " | ".join(PHASES) + " | state held (GiB) | s/step |")
    print("| --- | ---: | " + " | ".join(["---:"] * len(PHASES)) + " | ---: | ---: |")
    for name, (script, extra) in APPROACHES.items():
        if args.only and args.only not in name:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            copy = copy_with_your_functions(script, Path(tmp) / "copy", MEASURED)
            (Path(tmp) / "memory").mkdir()
            run(launch(copy, 2, *flags, *extra, "--output-dir", Path(tmp) / "out"), timeout=3600, cwd=Path(tmp),
                env={"MEMORY": str(Path(tmp) / "memory"), "GPT2_CONFIG": config, "OMP_NUM_THREADS": "1",
                     "TOKENS": str(args.tokens)})
            m = metrics(Path(tmp) / "out")[-1]
            state = (m["params_mb"] + m["grads_mb"] + m["optimizer_mb"]) / 1024
            for rank in (0, 1):
                found = peaks(Path(tmp) / "memory" / str(rank))
                cells = " | ".join(f"{found[p]:.2f}" if p in found else "-" for p in PHASES)
                print(f"| {name} | {rank} | {cells} | {state:.2f} | {m['epoch_time_s'] / 2:.1f} |", flush=True)


if __name__ == "__main__":
    main()
