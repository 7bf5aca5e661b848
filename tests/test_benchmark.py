"""The benchmark's quick mode runs end to end and prints its table (speed is not checked)."""
from processes import PYTHON, run


def test_quick_benchmark_prints_the_table_and_ratios():
    result = run([PYTHON, "tests/benchmark.py", "--quick", "--repeats", "1", "--fake-size", "512", "--epochs", "2"],
                 timeout=600)
    lines = result.stdout.splitlines()
    rows = [line for line in lines if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + 8, result.stdout  # header and one row per approach
    for row in rows[1:]:
        seconds, images_per_s = row.split("|")[4], row.split("|")[5]
        assert float(seconds.split()[0]) > 0 and float(images_per_s) > 0, row
    for ratio in ("- scaling:", "- DDP overhead at world size 1:", "- accumulation:", "- data loading:"):
        assert any(line.startswith(ratio) for line in lines), ratio
    assert any(line.startswith("Hardware: ") for line in lines)
