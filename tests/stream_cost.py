"""What the split of a stream costs in reading: every rank and DataLoader worker reads the whole stream, and decodes
only its own samples (in collate). Times one pass over 100 000 JSON lines of 12 to 200 token ids: reading the
lines, and decoding them with json.loads.

    python tests/stream_cost.py
"""
import json
import random
import statistics
import tempfile
import time
from pathlib import Path


def seconds(work, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "part-0.jsonl"
        path.write_text("".join(json.dumps({"text": [rng.randrange(1, 30000) for _ in range(rng.randrange(12, 200))],
                                            "label": rng.randrange(4)}) + "\n" for _ in range(100_000)))
        lines = path.read_text().splitlines(keepends=True)

        def read():
            with open(path) as f:
                for _ in f:
                    pass

        read_s, decode_s = seconds(read), seconds(lambda: [json.loads(line) for line in lines])
        size = path.stat().st_size
    print(f"100 000 lines, {size / 2**20:.0f} MiB: reading {read_s:.3f} s, decoding {decode_s:.3f} s "
          f"({decode_s / read_s:.0f}x)")


if __name__ == "__main__":
    main()
