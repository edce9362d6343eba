"""Prompt sharding: partition per epoch, exact resume, no dataset in memory, jsonl and parquet."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from recipe_gkd.config import CONFIG_DIR, ConfigError, GKDConfig, load_config
from recipe_gkd.data import (
    Dataset,
    RecordFile,
    ShardedStream,
    answer_reward,
    check_record_fields,
    check_record_teachers,
    encode_prompt,
    encode_response,
    epoch_order,
)


def _write_jsonl(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "response": f"r{i}", "i": i}) + "\n" for i in range(n)))
    return path


def _write_parquet(path: Path, n: int, row_group_size: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"prompt": [f"p{i}" for i in range(n)], "i": list(range(n))})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("size", [2, 10, 13])
def test_shards_partition_each_epoch(tmp_path: Path, world: int, size: int) -> None:
    dataset = Dataset([str(_write_jsonl(tmp_path / "d.jsonl", size))], "data.train_files")
    streams = [ShardedStream(dataset, seed=7, rank=r, world=world) for r in range(world)]
    per_worker = 3 * size  # three epochs' worth of stream over all workers
    taken = [s.take(per_worker // world + 1) for s in streams]
    for epoch in range(2):
        shard = {r: [p.sample_id for p in taken[r] if p.epoch == epoch] for r in range(world)}
        ids = [i for r in range(world) for i in shard[r]]
        assert sorted(ids) == list(range(size)), "each epoch covers the dataset exactly once"
        sizes = [len(shard[r]) for r in range(world)]
        assert max(sizes) - min(sizes) <= 1, sizes
    # The records are the ones the ids point to.
    assert all(p.record["i"] == p.sample_id for ps in taken for p in ps)


def test_step_batches_are_contiguous_blocks_of_the_epoch_order(tmp_path: Path) -> None:
    dataset = Dataset([str(_write_jsonl(tmp_path / "d.jsonl", 24))], "data.train_files")
    world, per_worker = 3, 2
    streams = [ShardedStream(dataset, seed=1, rank=r, world=world) for r in range(world)]
    order = epoch_order(24, seed=1, epoch=0)
    for step in range(4):
        batch = {p.sample_id for s in streams for p in s.take(per_worker)}
        assert batch == set(order[step * 6 : (step + 1) * 6].tolist())


def test_resume_from_position_continues_identically(tmp_path: Path) -> None:
    dataset = Dataset([str(_write_jsonl(tmp_path / "d.jsonl", 11))], "data.train_files")
    straight = ShardedStream(dataset, seed=3, rank=1, world=3)
    full = [p.sample_id for p in straight.take(20)]
    first = ShardedStream(dataset, seed=3, rank=1, world=3)
    head = [p.sample_id for p in first.take(8)]
    resumed = ShardedStream(dataset, seed=3, rank=1, world=3)
    resumed.position = first.position
    assert head + [p.sample_id for p in resumed.take(12)] == full


def test_order_depends_on_seed_and_epoch() -> None:
    a, b, c = epoch_order(50, 1, 0), epoch_order(50, 1, 1), epoch_order(50, 2, 0)
    assert sorted(a.tolist()) == list(range(50))
    assert a.tolist() != b.tolist() and a.tolist() != c.tolist()
    assert a.tolist() == epoch_order(50, 1, 0).tolist()


def test_parquet_matches_jsonl(tmp_path: Path) -> None:
    jsonl = Dataset([str(_write_jsonl(tmp_path / "d.jsonl", 37))], "data.train_files")
    parquet = Dataset([str(_write_parquet(tmp_path / "d.parquet", 37, row_group_size=5))], "data.train_files")
    assert len(parquet) == 37
    for rank in range(2):
        a = [p.sample_id for p in ShardedStream(jsonl, 5, rank, 2).take(30)]
        b = ShardedStream(parquet, 5, rank, 2).take(30)
        assert a == [p.sample_id for p in b] and all(p.record["i"] == p.sample_id for p in b)


def test_several_files_are_one_dataset(tmp_path: Path) -> None:
    first = _write_jsonl(tmp_path / "a.jsonl", 3)
    second = tmp_path / "b.jsonl"
    second.write_text("\n" + json.dumps({"prompt": "x", "i": 3}) + "\n\n")
    dataset = Dataset([str(first), str(second)], "data.train_files")
    assert len(dataset) == 4 and dataset[3]["i"] == 3


def test_bad_files_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        Dataset([str(tmp_path / "missing.jsonl")], "data.eval_files")
    assert info.value.key == "data.eval_files"
    with pytest.raises(ConfigError):
        Dataset([], "data.train_files")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match=r"jsonl or \.parquet"):
        RecordFile(tmp_path / "d.csv")
    (tmp_path / "bad.jsonl").write_text('{"prompt": 1}\nnot json\n')
    with pytest.raises(ValueError, match="line 2"):
        RecordFile(tmp_path / "bad.jsonl")[1]


def test_encode_with_chat_template(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = encode_prompt(tokenizer, {"q": "ab c"}, "q", chat_template=True)
    assert tokenizer.decode(ids) == "<bos><user>ab c<assistant>"
    plain = encode_prompt(tokenizer, {"q": "ab c"}, "q", chat_template=False)
    assert tokenizer.decode(plain).endswith("ab c")
    assert encode_response(tokenizer, {"r": "xy"}, "r", tokenizer.eos_token_id)[-1] == tokenizer.eos_token_id
    assert encode_response(tokenizer, {"r": "xy"}, "r", 7)[-1] == 7  # closed by the stop set's closing id
    with pytest.raises(ConfigError) as info:
        encode_prompt(tokenizer, {"question": "x"}, "prompt", chat_template=True)
    assert info.value.key == "data.prompt_key"


READER = """
import resource, sys
from recipe_gkd.data import Dataset, ShardedStream
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
stream = ShardedStream(Dataset([sys.argv[1]], "data.train_files"), seed=0, rank=1, world=4)
for _ in range(20):
    stream.take(16)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def test_worker_memory_does_not_hold_the_dataset(tmp_path: Path) -> None:
    # ~60 MB of prompts: a reader holding the records would grow by at least that much.
    big = tmp_path / "big.jsonl"
    padding = "x" * 1500
    with big.open("w") as f:
        for i in range(40_000):
            f.write(json.dumps({"prompt": f"{i} {padding}"}) + "\n")
    assert big.stat().st_size > 55e6
    proc = subprocess.run(
        [sys.executable, "-c", READER, str(big)], capture_output=True, text=True, timeout=120, check=True
    )
    grown_kib = int(proc.stdout.strip())
    assert grown_kib < 10_000, f"reader grew by {grown_kib} KiB for a 60 MB dataset"


def _driver_check_peak_bytes(tmp_path: Path, records: int, suffix: str) -> int:
    """tracemalloc's peak over the driver's checks of every record (each names its teacher and carries the field its
    teacher's prompt reads) of a file of `records` records."""
    import tracemalloc

    rows = [{"prompt": f"rev:{i}", "hint": f"h{i}" * 20, "teacher": ("reverse", "sum")[i % 2]} for i in range(records)]
    path = tmp_path / f"{records}{suffix}"
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=1000)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    files = [f"data.train_files=[{path}]", "data.eval_files=[]", "trainer.eval_every=0"]
    teachers = load_config(CONFIG_DIR / "presets" / "cpu_two_teachers.yaml", files)
    privileged = load_config(
        CONFIG_DIR / "presets" / "cpu_privileged.yaml", [*files, "data.teacher_prompt_template='{prompt} {hint}'"]
    )
    tracemalloc.start()
    try:
        check_record_teachers(teachers)
        check_record_fields(privileged)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_the_drivers_checks_of_every_record_do_not_hold_the_dataset(tmp_path: Path, suffix: str) -> None:
    """The driver reads every local record for the teacher it names and its teacher prompt's fields before anything
    starts: record by record (a parquet file a batch of rows at a time), so ten times the records take no more
    memory (a list of every record's value grows by ~8 MiB here, by gigabytes for tens of millions of records)."""
    small = _driver_check_peak_bytes(tmp_path, 5_000, suffix)
    big = _driver_check_peak_bytes(tmp_path, 50_000, suffix)
    assert big < small + 256 * 1024, f"peak {small / 2**20:.2f} MiB for 5,000 records, {big / 2**20:.2f} MiB for 50,000"


def _cfg_with(files: list[Path], **data: str) -> GKDConfig:
    cfg = GKDConfig()
    cfg.data.train_files = [str(f) for f in files]
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


def test_record_fields_are_checked_from_the_first_record(tmp_path: Path) -> None:
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text('\n{"prompt": "p", "response": "r"}\nnot json at all\n')
    parquet = _write_parquet(tmp_path / "b.parquet", 5, 2)
    check_record_fields(_cfg_with([jsonl, parquet]))  # only the first record is read
    with pytest.raises(ConfigError) as info:
        check_record_fields(_cfg_with([jsonl, parquet], prompt_key="question"))
    assert info.value.key == "data.prompt_key" and "a.jsonl" in str(info.value)
    cfg = _cfg_with([parquet], response_key="answer_text")
    check_record_fields(cfg)  # lmbda = 1: the response is not read
    cfg.algorithm.lmbda = 0.5
    with pytest.raises(ConfigError, match=r"data\.response_key"):
        check_record_fields(cfg)


@pytest.mark.parametrize(
    ("text", "match"), [("", "holds no records"), ("[1, 2]\n", "JSON objects"), ("{oops\n", "not JSON")]
)
def test_unreadable_first_record_names_the_files_key(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as info:
        check_record_fields(_cfg_with([path]))
    assert info.value.key == "data.train_files"


@pytest.mark.parametrize(
    ("response", "answer", "match", "expected"),
    [
        (" edcba ", "edcba", "exact", 1.0),
        ("edcbaa", "edcba", "exact", 0.0),
        ("+8=8+3=11+1=12+6=18", "=18", "suffix", 1.0),
        ("+8=8+3=11+1=12+6=118", "=18", "suffix", 0.0),  # the final total, not its last digits
        ("+8=8+3=11+1=12+6=18", "=18", "exact", 0.0),
    ],
)
def test_answer_reward_compares_the_whole_response_or_its_end(
    response: str, answer: str, match: str, expected: float
) -> None:
    assert answer_reward(response, answer, match) == expected


def test_an_unknown_answer_match_is_refused() -> None:
    with pytest.raises(ValueError, match=r"data\.answer_match"):
        answer_reward("a", "a", "prefix")
    with pytest.raises(ConfigError, match=r"data\.answer_match"):
        load_config(None, ["data.answer_match=prefix"])
