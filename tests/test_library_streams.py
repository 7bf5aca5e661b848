"""Streams as users have them, with the real libraries: a Hugging Face `datasets` streaming dataset (4 files, and 1)
and a webdataset pipeline over tar shards, each as docs/your-project.md shows it, pasted into the scripts. Nothing is
lost under DataLoader workers (every full global batch trained on, every validation sample counted once), each
sample is read once over 2 processes x 2 workers (a stream of one shard once per process) and collated once, in a
worker; 2 processes train what 1 does, in every script; a stop mid-epoch continues exactly; what cannot work is one
line."""

from __future__ import annotations

import collections
import re
import shutil
import time
from pathlib import Path

import pytest

from processes import ends_every_rank_with, finish, metrics, run_parallel, start, steps
from test_streams import assert_trained_as_the_reference, docs_example, write_json_lines
from projects import copy_with_your_functions, launch

datasets = pytest.importorskip("datasets")  # test-only dependencies (tests/requirements.txt)
pytest.importorskip("webdataset")

# the docs' examples as a user pastes them, the webdataset one last; then what the tests count and where they stop
DOCS = (
    docs_example("A complete example")
    + docs_example("### A Hugging Face streaming dataset")
    + "\n\nHF_DATASETS, HF_COLLATE = build_datasets, collate\n\n"
    + docs_example("### A webdataset pipeline")
)
COUNTED = (
    DOCS
    + '''

import os
import signal

WDS_DATASETS, WDS_COLLATE = build_datasets, collate


def note(what, samples):
    """Which process read (or decoded) which samples: a line each in $COUNTS/what."""
    with open(os.path.join(os.environ["COUNTS"], what), "a") as f:
        f.write("".join(f"{os.getpid()} {s['id'] if 'id' in s else s['__key__']}\\n" for s in samples))


class CountedTarShards(TarShards):
    def __iter__(self):
        for sample in super().__iter__():
            note("read", [sample])
            yield sample


def build_datasets(args):
    if os.environ["STREAMS"] == "webdataset":
        train, val, classes = WDS_DATASETS(args)
        return CountedTarShards(train.urls, train.seed), CountedTarShards(val.urls), classes
    train, val, classes = HF_DATASETS(args)
    return train.map(lambda row: note("read", [row]) or row), val.map(lambda row: note("read", [row]) or row), classes


def collate(samples):
    note("decoded", samples)
    return (WDS_COLLATE if os.environ["STREAMS"] == "webdataset" else HF_COLLATE)(samples)


class StoppedAt(MeanOfEmbeddings):
    """Rank 0 sends itself SIGTERM (a preemption) in its training forward TERM_AT_FORWARD, if set."""
    forwards = 0

    def forward(self, input_ids, attention_mask):
        self.forwards += self.training
        if self.forwards == int(os.environ.get("TERM_AT_FORWARD", 0)) and os.environ.get("RANK", "0") == "0":
            os.kill(os.getpid(), signal.SIGTERM)
        return super().forward(input_ids, attention_mask)


def build_model(args, num_classes):
    return StoppedAt(1000, num_classes)
'''
)

FLAGS = [
    "--batch-size",
    "32",
    "--epochs",
    "2",
    "--steps-per-epoch",
    "37",
    "--lr",
    "0.5",
    "--print-freq",
    "6",
    "--eval-every",
    "16",
    "--timeout",
    "60",
]
# each stream's files (rows a file), in a folder of its own: 1200 training rows, 200 validation rows
DATA = {
    "huggingface": (
        [300] * 4,
        [200],
        False,
    ),  # 37 full global batches (of 8 rows from each file) an epoch
    "one file": ([1200], [200], False),  # a stream of one shard: every process reads it whole
    # files as they come: the 200-row one ends after step 25, then the rest of the others makes 12 batches more
    "uneven": ([400, 350, 250, 200], [200], False),
    "webdataset": ([300, 300, 300, 280], [100, 100], True),
}  # 35 steps of 4 shards, then 1 of the rest (60)
FULL_STEPS = {"huggingface": 37, "one file": 37, "uneven": 37, "webdataset": 36}
TERM_IN_EPOCH_2 = {
    "huggingface": str(1 + 37 + 7),
    "uneven": str(1 + 37 + 30),
}  # the start-up check's forward,
STOPPED_AFTER = {
    "huggingface": 8,
    "uneven": 31,
}  # epoch 1's 37, then epoch 2's: stopped after that step
# the other scripts: (name, script, processes, flags, equal to the reference within)
SCRIPTS = [
    ("dataparallel", "dataparallel.py", 1, ["--workers", "2"], 1e-6),
    ("mp", "distributed_mp.py", 2, ["--workers", "0"], 1e-5),
    ("amp", "distributed_amp.py", 2, ["--workers", "0", "--amp-dtype", "bfloat16"], None),  # learns
    (
        "accumulation",
        "distributed_grad_accum.py",
        2,
        ["--workers", "1", "--accum-steps", "2"],
        1e-5,
    ),
    ("fsdp", "distributed_fsdp.py", 2, ["--workers", "1"], 1e-5),
]


def prepare(base: Path, stream: str) -> Path:
    """The folder a run of this stream starts in: its data, and the scripts with the user's code pasted in."""
    folder = base / stream.replace(" ", "-")
    if not folder.exists():
        train, val, tar = DATA[stream]
        write_json_lines(folder / "data" / "train", len(train), train, seed=1, tar=tar)
        write_json_lines(folder / "data" / "val", len(val), val, seed=2, tar=tar)
    return folder


def environment(base: Path, stream: str, counts: Path) -> dict:
    """Which stream the user's code builds, offline (no hub is reached), and where it notes what it read."""
    return {
        "STREAMS": "webdataset" if stream == "webdataset" else "huggingface",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(base / "hf-home"),
        "COUNTS": str(counts),
    }


def run_spec(base: Path, stream: str, name: str, script: str, processes: int, flags, env=None):
    folder = prepare(base, stream)
    copy = copy_with_your_functions(script, folder / f"copy-{script}", COUNTED)
    (folder / name / "counts").mkdir(parents=True)
    env = {**environment(base, stream, folder / name / "counts"), **(env or {})}
    return launch(copy, processes, *FLAGS, *flags, "--output-dir", folder / name), env, folder


@pytest.fixture(scope="module")
def library_runs(tmp_path_factory):
    """Every run at once: per stream the reference (1 process, no workers) and 2 processes x 2 workers; the Hugging
    Face stream also stopped by SIGTERM in epoch 2's step 7, and it and webdataset's in every other script."""
    base = tmp_path_factory.mktemp("library-streams")
    specs = {}
    for stream in DATA:
        specs[stream, "one"] = ("distributed.py", 1, ["--workers", "0"], {})
        specs[stream, "two"] = ("distributed.py", 2, ["--workers", "2"], {})
    for stream, forward in TERM_IN_EPOCH_2.items():
        specs[stream, "stopped"] = (
            "distributed.py",
            2,
            ["--workers", "2"],
            {"TERM_AT_FORWARD": forward},
        )
    for stream in ("huggingface", "webdataset"):
        for name, script, processes, flags, _ in SCRIPTS:
            specs[stream, name] = (script, processes, flags, {})
    commands = {key: run_spec(base, key[0], key[1], *spec) for key, spec in specs.items()}
    results = run_parallel(list(commands.values()), timeout=500, check=False, at_once=8)
    for (cmd, env, folder), result in zip(commands.values(), results):
        result.folder = folder
    return base, dict(zip(commands, results))


def output(library_runs, stream: str, name: str) -> Path:
    result = library_runs[1][stream, name]
    assert result.returncode == 0, result.stderr[-3000:]
    return result.folder / name


def counted(out: Path, what: str) -> collections.Counter:
    """(process, sample) -> how often that process read or decoded that sample over the run."""
    path = out / "counts" / what
    return collections.Counter(tuple(line.split()) for line in path.read_text().splitlines())


@pytest.mark.parametrize("stream", DATA)
def test_a_library_stream_loses_nothing_with_workers_and_trains_as_one_process(
    stream, library_runs
):
    two, one = output(library_runs, stream, "two"), output(library_runs, stream, "one")
    for run in (one, two):
        records = steps(run)
        # every full global batch of each epoch: the webdataset shards' end, on every rank after the same step
        assert [
            max(r["step"] for r in records if r["epoch"] == e and "train_loss" in r) for e in (1, 2)
        ] == [FULL_STEPS[stream]] * 2
        assert {r["val_images"] for r in records if "val_images" in r} == {
            200
        }  # each validation sample once
    assert_trained_as_the_reference(two, one, 1e-5)
    assert metrics(two)[-1]["val_acc"] > 0.9


@pytest.mark.parametrize("stream", ["huggingface", "webdataset"])
@pytest.mark.parametrize("case", SCRIPTS, ids=[case[0] for case in SCRIPTS])
def test_a_library_stream_trains_in_every_script(case, stream, library_runs):
    name, tolerance = case[0], case[4]
    out = output(library_runs, stream, name)
    assert {r["val_images"] for r in steps(out) if "val_images" in r} == {200}
    assert max(r["step"] for r in steps(out) if "train_loss" in r) == FULL_STEPS[stream]
    if tolerance:
        assert_trained_as_the_reference(out, output(library_runs, stream, "one"), tolerance)
    else:
        assert metrics(out)[-1]["val_acc"] > 0.9


def per_row(counts: collections.Counter, prefix: str) -> collections.Counter:
    """How often each row whose id starts with prefix ("1-": training, "2-": validation) was read or decoded."""
    rows = collections.Counter()
    for (_, row), times in counts.items():
        rows[row] += times if row.startswith(prefix) else 0
    return +rows


@pytest.mark.parametrize("stream", DATA)
def test_each_sample_is_read_once_over_processes_and_workers_and_decoded_once_in_a_worker(
    stream, library_runs
):
    """2 processes x 2 workers, 2 epochs: the main processes alone read, each training row once an epoch (one of
    them reads each shard; a one-shard stream is read by both), and each validation row once a validation (both read
    one file); the workers collate. The start-up check adds its 256 samples of the first shard on each process,
    which the main process reads and decodes (and 2 of them again): fewer where the first shard is smaller. Shards
    of different sizes change none of it: what is left of the others after the first has ended is still read once."""
    out = output(library_runs, stream, "two")
    reads, decodes = counted(out, "read"), counted(out, "decoded")
    main = {pid for pid, _ in reads}
    collated_by = collections.Counter(
        pid for (pid, _), times in decodes.items() for _ in range(times)
    )
    first = {collated_by[pid] - 2 for pid in main}  # the start-up's samples, of the first shard
    assert (
        len(main) == 2
        and len(first) == 1
        and first <= {256, *DATA[stream][0]}
        and len(collated_by) >= 6
    )
    train, start_up, rows = per_row(reads, "1-"), 2 * first.pop(), sum(DATA[stream][0])
    readers = 2 if stream == "one file" else 1  # processes that read each training row in an epoch
    assert (
        len(train) == rows and max(train.values()) <= 2 * readers + 2
    )  # 2 epochs, and the start-up's
    assert sum(train.values()) <= 2 * readers * rows + start_up
    validations = sum("val_images" in record for record in steps(out))
    assert set(per_row(reads, "2-").values()) == {
        validations * (1 if stream == "webdataset" else 2)
    }
    assert set(per_row(decodes, "2-").values()) == {validations}
    trained = (
        2 * FULL_STEPS[stream] * 32
    )  # 2 epochs' samples, each collated once; a rank's 4 batches read ahead
    assert (
        trained <= sum(per_row(decodes, "1-").values()) - start_up - 4 <= trained + 2 * 2 * 4 * 16
    )


@pytest.mark.parametrize("stream", TERM_IN_EPOCH_2)
def test_a_library_stream_stopped_mid_epoch_continues_exactly_on_two_processes_and_on_one(
    stream, library_runs
):
    """Stopped in epoch 2, of 4 files of 300 rows at step 8, or of 400, 350, 250 and 200 rows at step 31, after the
    200-row one ended (step 25): continued on 2 processes and on 1, as if never stopped."""
    base, results = library_runs
    stopped, step = results[stream, "stopped"], STOPPED_AFTER[stream]
    assert (
        stopped.returncode != 0
        and f"stopped by SIGTERM after step {step}/37 of epoch 2" in stopped.stderr
    ), stopped.stderr
    folder = stopped.folder
    for name in ("on-two", "on-one"):
        shutil.copytree(folder / "stopped", folder / name)
        shutil.rmtree(folder / name / "counts")
    again, on_one = run_parallel(
        [
            run_spec(base, stream, "on-two", "distributed.py", 2, ["--workers", "2"]),
            run_spec(base, stream, "on-one", "distributed.py", 1, ["--workers", "0"]),
        ],
        timeout=300,
    )
    assert f"1 of 2 epochs done and {step} steps of the next" in again.stdout
    reference = output(library_runs, stream, "two")
    assert_trained_as_the_reference(folder / "on-two", reference, 1e-6)
    assert_trained_as_the_reference(folder / "on-one", reference, 1e-5)


def test_a_stream_that_splits_itself_ends_every_rank_with_one_line(tmp_path):
    """split_dataset_by_node (the step the docs say to leave out), and webdataset's default node splitter."""
    split = COUNTED.replace(
        "    return train.map(",
        "    from datasets.distributed import split_dataset_by_node\n    "
        "train = split_dataset_by_node(train, int(os.environ['RANK']), 2)\n    return train.map(",
    )
    refused = COUNTED.replace("nodesplitter=None", "nodesplitter=wds.shardlists.single_node_only")
    runs = {
        "split": (
            split,
            "huggingface",
            "error: the stream gives the processes different first samples",
        ),
        "default": (
            refused,
            "webdataset",
            "error: the stream cannot be read (you need to add an explicit nodesplitter",
        ),
    }
    started = {}
    for name, (code, streams, _) in runs.items():
        data = prepare(tmp_path, streams)
        copy = copy_with_your_functions("distributed.py", tmp_path / f"copy-{name}", code)
        (tmp_path / name).mkdir()
        started[name] = start(
            launch(copy, 2, *FLAGS, "--workers", "2", "--output-dir", tmp_path / name / "out"),
            env=environment(tmp_path, streams, tmp_path / name),
            cwd=data,
        )
    for name, (_, _, line) in runs.items():
        ends_every_rank_with(finish(*started[name], timeout=120), line, 2)


# the user's own per-sample function in the webdataset pipeline, and their collate, each with a bug everyone makes
# (a label that json already made an int, decoded again; a key misspelt) on the samples of one shard after FAIL_AFTER
BUGGY = (
    DOCS.replace(
        ".shuffle(100, seed=self.seed + self.epoch)",
        ".shuffle(100, seed=self.seed + self.epoch).map(check_sample)",
    )
    + """

import collections
import os

SEEN = collections.Counter()  # samples of each shard this process has read or collated
WDS_COLLATE = collate


def is_bad(sample, where):
    SEEN[where, sample["__url__"]] += 1
    return where == os.environ["FAIL_IN"] and os.environ["FAIL_SHARD"] in sample["__url__"] and SEEN[
        where, sample["__url__"]] > int(os.environ["FAIL_AFTER"])


def check_sample(sample):
    if is_bad(sample, "stream"):
        json.loads(sample["json"])["label"].decode()  # the user's bug, in the stream
    return sample


def collate(samples):
    if any(is_bad(sample, "collate") for sample in samples):
        json.loads(samples[0]["json"])["lable"]  # the user's bug, in collate
    return WDS_COLLATE(samples)
"""
)
# where the bug is, on the samples of which shard, after how many of it, DataLoader workers, ranks that raise it
BUGS = {
    "stream, first sample": ("stream", "part-0", 0, 0, 2),
    "stream, mid-epoch on rank 1": ("stream", "part-3", 40, 2, 1),  # only rank 1 reads shard 3
    "collate, first batch": ("collate", "part-0", 0, 0, 2),
    "collate in a worker, mid-epoch on rank 1": ("collate", "part-3", 40, 2, 1),
}
ERRORS = {
    "stream": ("AttributeError: 'int' object has no attribute 'decode'", 'label"].decode()'),
    "collate": ("KeyError: 'lable'", '["lable"]'),
}


def test_an_error_in_the_users_stream_or_collate_reaches_them_as_it_is_and_ends_every_rank(
    tmp_path,
):
    """The user's own error, with their line as the traceback's last, on each rank that raised it, whether at the
    first sample (read and collated by the start-up check) or mid-epoch on one rank, in the stream (read in the main
    process) or in collate (in the main process, or in a DataLoader worker); every process ends at once, no rank left
    in a collective (--timeout 300: the watchdog and the collectives' timeout would take 5 minutes)."""
    data, started = prepare(tmp_path, "webdataset"), {}
    copy = copy_with_your_functions("distributed.py", tmp_path / "copy", BUGGY)
    for name, (where, shard, after, workers, _) in BUGS.items():
        out = tmp_path / name.replace(" ", "-").replace(",", "")
        env = {
            **environment(tmp_path, "webdataset", out),
            "FAIL_IN": where,
            "FAIL_SHARD": shard,
            "FAIL_AFTER": str(after),
        }
        started[name] = (
            time.monotonic(),
            start(
                launch(
                    copy,
                    2,
                    *FLAGS,
                    "--workers",
                    str(workers),
                    "--timeout",
                    "300",
                    "--output-dir",
                    out,
                ),
                env=env,
                cwd=data,
            ),
        )
    for name, (began, (proc, marker)) in started.items():
        result, (where, *_, ranks) = finish(proc, marker, timeout=240), BUGS[name]
        assert result.returncode != 0 and time.monotonic() - began < 150, result.stderr
        error, line = ERRORS[where]
        assert result.stderr.count(error) >= ranks, result.stderr
        for traceback in result.stderr.split(error)[:-1]:  # each one's last frame: the user's line
            last = re.findall(r'File "([^"]+)", line \d+, in (\w+)\n\s*(.*)', traceback)[-1]
            assert Path(last[0]).name == "distributed.py" and line in last[2], (
                name,
                traceback[-2000:],
            )
