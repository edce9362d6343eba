"""Prompt datasets read by the rollout workers themselves: indexed files, sharded streams.

No process holds the dataset. A `RecordFile` index keeps one byte offset per jsonl line (or
the row-group layout of a parquet file) and reads records on demand; a Hugging Face dataset
(`HFRecords`: a `save_to_disk` directory, or a hub id with its split read through the `datasets`
cache) is Arrow memory-mapped from disk. The global order is a
permutation fixed by (seed, epoch); epochs are concatenated into one stream, and worker r of
R takes stream positions r, r+R, r+2R, ... . So, per epoch, the workers' shards partition the
dataset (sizes differ by at most 1, no prompt twice), a step's prompts over all workers are
one contiguous block of the stream, and a worker's position is simply how many prompts it
has consumed (resumable from the step number alone). This works for any dataset size,
including one smaller than the number of workers.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recipe_gkd.config import ANSWER_MATCHES, ConfigError, GKDConfig
from recipe_gkd.config.teachers import record_teacher, records_name_teachers, teacher_handles
from recipe_gkd.messages import checked_messages, prompt_messages

RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")
# Rows of a parquet file read at a time where the driver checks every record.
PARQUET_BATCH_ROWS = 4096
# A hub dataset: ORG/NAME:SPLIT or ORG/NAME/CONFIG:SPLIT (NAME:SPLIT for the few without an org).
HUB_DATASET = re.compile(r"^(?P<repo>[\w.-]+(?:/[\w.-]+)?)(?:/(?P<config>[\w.-]+))?:(?P<split>[\w.-]+)$")
DATA_SOURCES = (
    "a .jsonl or .parquet file, a datasets save_to_disk directory (DIR, or DIR:SPLIT for a DatasetDict) "
    "or a hub dataset with its split (ORG/NAME:SPLIT or ORG/NAME/CONFIG:SPLIT)"
)


def open_records(source: str, key: str) -> RecordFile | HFRecords:
    """One entry of data.train_files / data.eval_files (`key`), opened for random access."""
    if Path(source).is_file():
        return RecordFile(source, key)
    directory, _ = split_source(source)
    if Path(directory).is_dir() or HUB_DATASET.match(source):
        return HFRecords(source, key)
    raise ConfigError(key, f"no such data file, directory or hub dataset {source!r}: give {DATA_SOURCES}")


def split_source(source: str) -> tuple[str, str]:
    """(path or hub id, split) of a data source: DIR, DIR:SPLIT or ORG/NAME:SPLIT; the split may be ''."""
    if Path(source).is_dir() or ":" not in source:
        return source, ""
    base, _, split = source.rpartition(":")
    return base, split


class HFRecords:
    """Random access to the rows of a Hugging Face dataset (Arrow files, memory-mapped: nothing is loaded).

    `source`: a `save_to_disk` directory (a Dataset; a DatasetDict as DIR:SPLIT), or a hub id with its
    split, read through the `datasets` cache (HF_DATASETS_OFFLINE=1: the cache only, no network).
    """

    def __init__(self, source: str, key: str) -> None:
        self.source = source
        self.dataset = _load_hf_dataset(source, key)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        return dict(self.dataset[int(index)])

    @property
    def fields(self) -> set[str]:
        return set(self.dataset.column_names)


def _load_hf_dataset(source: str, key: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise ConfigError(key, f"{source!r} is a Hugging Face dataset: pip install datasets") from None
    directory, split = split_source(source)
    if Path(directory).is_dir():
        try:
            loaded = datasets.load_from_disk(directory)
        except FileNotFoundError as err:
            raise ConfigError(key, f"{directory} is not a datasets save_to_disk directory ({err})") from None
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ConfigError(
                    key, f"{directory} holds the splits {sorted(loaded)}: name one as {directory}:SPLIT, got {split!r}"
                )
            return loaded[split]
        if split:
            raise ConfigError(key, f"{directory} is a single dataset (no splits): give it without :{split}")
        return loaded
    match = HUB_DATASET.match(source)
    assert match is not None, "open_records sends hub ids only"
    try:
        return datasets.load_dataset(match["repo"], match["config"], split=match["split"])
    except (FileNotFoundError, ValueError, ConnectionError) as err:
        offline = (
            " (HF_DATASETS_OFFLINE=1: only the datasets cache is read)" if datasets.config.HF_DATASETS_OFFLINE else ""
        )
        first = (str(err).strip().splitlines() or [""])[0]
        raise ConfigError(
            key, f"hub dataset {source!r} could not be read{offline}: {type(err).__name__}: {first}"
        ) from None


class RecordFile:
    """Random access to the records of one jsonl or parquet file without loading it."""

    def __init__(self, path: str | Path, key: str = "data.train_files") -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(key, f"no such data file {self.path}")
        self._parquet: Any = None
        if self.path.suffix == ".parquet":
            self._open_parquet()
        elif self.path.suffix in (".jsonl", ".json"):
            self._offsets = _line_offsets(self.path)
        else:
            raise ConfigError(key, f"{self.path}: expected .jsonl or .parquet")

    def _open_parquet(self) -> None:
        import pyarrow.parquet as pq

        self._parquet = pq.ParquetFile(self.path)
        rows = [self._parquet.metadata.row_group(i).num_rows for i in range(self._parquet.num_row_groups)]
        self._group_starts = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        self._cached_group: tuple[int, list[dict[str, Any]]] | None = None

    def __len__(self) -> int:
        if self._parquet is not None:
            return int(self._group_starts[-1])
        return len(self._offsets)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        if self._parquet is not None:
            return self._parquet_row(index)
        with self.path.open("rb") as f:
            f.seek(int(self._offsets[index]))
            line = f.readline()
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{self.path} line {index + 1}: invalid JSON ({err})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{self.path} line {index + 1}: expected a JSON object")
        return record

    def _parquet_row(self, index: int) -> dict[str, Any]:
        group = int(np.searchsorted(self._group_starts, index, side="right") - 1)
        if self._cached_group is None or self._cached_group[0] != group:
            # One row group at a time: bounded memory, sequential reads stay cheap.
            self._cached_group = (group, self._parquet.read_row_group(group).to_pylist())
        return self._cached_group[1][index - int(self._group_starts[group])]


def _line_offsets(path: Path) -> np.ndarray:
    """Byte offset of every non-empty line (int64), read in one streaming pass."""
    offsets = []
    position = 0
    with path.open("rb") as f:
        for line in f:
            if line.strip():
                offsets.append(position)
            position += len(line)
    return np.asarray(offsets, dtype=np.int64)


class Dataset:
    """Several record sources (files, Hugging Face datasets) seen as one indexed dataset."""

    def __init__(self, files: Sequence[str], key: str) -> None:
        if not files:
            raise ConfigError(key, "no data files given")
        self.files = [open_records(f, key) for f in files]
        self._starts = np.concatenate([[0], np.cumsum([len(f) for f in self.files])]).astype(np.int64)
        if len(self) == 0:
            raise ConfigError(key, f"{list(files)} hold no records")

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int) -> dict[str, Any]:
        file_index = int(np.searchsorted(self._starts, index, side="right") - 1)
        return self.files[file_index][index - int(self._starts[file_index])]


def epoch_order(size: int, seed: int, epoch: int) -> np.ndarray:
    """The global order of epoch `epoch`: a permutation fixed by (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(size)


@dataclass(frozen=True)
class Prompt:
    sample_id: int  # index in the dataset
    epoch: int
    record: dict[str, Any]


class ShardedStream:
    """Worker `rank` of `world`'s share of the epoch-concatenated prompt stream.

    The k-th prompt this worker reads is stream position k * world + rank. `position` (prompts
    consumed) is the whole state: set it to resume.
    """

    def __init__(self, dataset: Dataset, seed: int, rank: int, world: int) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world {world}")
        self.dataset = dataset
        self.seed = seed
        self.rank = rank
        self.world = world
        self.position = 0
        self._order: tuple[int, np.ndarray] | None = None

    def _stream_index(self, k: int) -> tuple[int, int]:
        """(epoch, sample id) at this worker's k-th read."""
        global_position = k * self.world + self.rank
        epoch, offset = divmod(global_position, len(self.dataset))
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(len(self.dataset), self.seed, epoch))
        return epoch, int(self._order[1][offset])

    def take(self, count: int) -> list[Prompt]:
        """The next `count` prompts of this worker's shard."""
        prompts = []
        for k in range(self.position, self.position + count):
            epoch, sample_id = self._stream_index(k)
            prompts.append(Prompt(sample_id, epoch, self.dataset[sample_id]))
        self.position += count
        return prompts


def check_record_fields(cfg: GKDConfig) -> None:
    """The first record of every data file has the fields the run reads (driver side, before anything
    starts; reads one record per file, never the dataset). Raises ConfigError naming the key."""
    needed = [("data.prompt_key", cfg.data.prompt_key)]
    if cfg.algorithm.lmbda < 1:
        needed.append(("data.response_key", cfg.data.response_key))
    # Each teacher's own prompt (privileged context): the fields its rule reads, named by the key that set it.
    for handle in teacher_handles(cfg).values():
        needed += [(key, field_name) for field_name, key in handle.prompt.record_fields().items()]
    for files_key, files in (("data.train_files", cfg.data.train_files), ("data.eval_files", cfg.data.eval_files)):
        for file in files:
            fields = first_record_fields(file, files_key)
            for key, field_name in needed:
                if field_name not in fields:
                    raise ConfigError(key, f"{file}: records have no field {field_name!r} (fields: {sorted(fields)})")
    check_teacher_prompt_fields(cfg)


def check_teacher_prompt_fields(cfg: GKDConfig) -> None:
    """Every record of the local data files has the fields its teachers' own prompts read (driver side, before
    training; docs/privileged_teacher.md); Hugging Face datasets are checked as the rollout workers read them.
    Raises ConfigError naming the key that set the rule and the record."""
    needed = {f: key for h in teacher_handles(cfg).values() for f, key in h.prompt.record_fields().items()}
    for file in [*cfg.data.train_files, *cfg.data.eval_files]:
        path = Path(file)
        if not path.is_file():
            continue
        for field_name, key in needed.items():
            for index, value in enumerate(_field_values(path, field_name, every=True)):
                if value is None:
                    raise ConfigError(
                        key,
                        f"record {index} of {path} has no field {field_name!r}: every record needs the teacher's prompt",
                    )


def check_record_teachers(cfg: GKDConfig) -> None:
    """Every record of the local data files names a configured teacher in data.teacher_key, or none
    (driver side, before training; docs/teachers.md). Hugging Face datasets are checked as the rollout
    workers read them. Raises ConfigError naming data.teacher_key, the value and the file."""
    if not records_name_teachers(cfg):
        return  # `teacher:` alone: data.teacher_key is not read
    for file in [*cfg.data.train_files, *cfg.data.eval_files]:
        path = Path(file)
        if not path.is_file():
            continue
        for index, value in enumerate(_field_values(path, cfg.data.teacher_key)):
            if value is not None:
                record_teacher(cfg, {cfg.data.teacher_key: value}, f"record {index} of {path}")


def _field_values(path: Path, field_name: str, every: bool = False) -> Iterator[Any]:
    """The value of `field_name` in each record of a local .jsonl / .parquet file, one record at a time (the driver
    checks datasets larger than its memory): None where absent; a parquet file without the column: no values, or
    with `every` one None per row."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.ParquetFile(path)
        if field_name not in table.schema_arrow.names:
            if every:
                yield from itertools.repeat(None, table.metadata.num_rows)
            return
        for batch in table.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field_name]):
            yield from batch.column(0).to_pylist()
        return
    with path.open("rb") as f:
        for line in f:
            if line.strip():
                yield json.loads(line).get(field_name)


def first_record_fields(source: str, key: str) -> set[str]:
    """Field names of a jsonl file's first record, a parquet file's or a Hugging Face dataset's columns."""
    records = open_records(source, key) if not Path(source).is_file() else None
    if isinstance(records, HFRecords):
        return records.fields
    path = Path(source)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return set(pq.read_schema(path).names)
    if path.suffix not in (".jsonl", ".json"):
        raise ConfigError(key, f"{path}: expected .jsonl or .parquet")
    with path.open("rb") as f:
        for line in f:
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ConfigError(key, f"{path}: the first record is not JSON ({err})") from None
                if not isinstance(record, dict):
                    raise ConfigError(key, f"{path}: records must be JSON objects, got {type(record).__name__}")
                return set(record)
    raise ConfigError(key, f"{path} holds no records")


def encode_prompt(tokenizer: Any, record: dict[str, Any], prompt_key: str, chat_template: bool) -> list[int]:
    """Token ids of a record's prompt, through the tokenizer's chat template when asked.

    The prompt is a string (one user turn) or a list of messages as chat datasets store them
    (`[{"role": ..., "content": ...}, ...]`): the conversation up to its last non-assistant turn,
    so a record that also holds the reference answer as its final assistant turn prompts without it.
    """
    if prompt_key not in record:
        raise ConfigError("data.prompt_key", f"record has no field {prompt_key!r} (fields: {sorted(record)})")
    prompt = record[prompt_key]
    if isinstance(prompt, list):
        if not chat_template:
            raise ConfigError(
                "data.apply_chat_template",
                f"data.prompt_key={prompt_key!r} holds messages: they need the chat template",
            )
        messages = prompt_messages(prompt, prompt_key)
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    if chat_template:
        messages = [{"role": "user", "content": str(prompt)}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    return list(tokenizer(str(prompt), add_special_tokens=True)["input_ids"])


def response_text(record: dict[str, Any], response_key: str) -> str:
    """A record's reference response: a string, or the last assistant turn of a message list."""
    if response_key not in record:
        raise ConfigError("data.response_key", f"record has no field {response_key!r} (fields: {sorted(record)})")
    value = record[response_key]
    if not isinstance(value, list):
        return str(value)
    answers = [
        m["content"] for m in checked_messages(value, "data.response_key", response_key) if m["role"] == "assistant"
    ]
    if not answers:
        raise ConfigError("data.response_key", f"{response_key!r} holds no assistant message")
    return answers[-1]


def encode_response(tokenizer: Any, record: dict[str, Any], response_key: str, closing_id: int | None) -> list[int]:
    """Token ids of a record's reference response, closed by `closing_id` (off-policy distillation: the stop set's
    closing id, the chat template's turn end or the EOS, as a sampled response ends)."""
    ids = list(tokenizer(response_text(record, response_key), add_special_tokens=False)["input_ids"])
    return ids if closing_id is None else [*ids, closing_id]


def answer_reward(response: str, answer: str, match: str = "exact") -> float:
    """1.0 when the response equals the answer (`exact`) or ends with it (`suffix`), both stripped; else 0.0."""
    if match not in ANSWER_MATCHES:
        raise ValueError(f"answer match {match!r}: expected one of {ANSWER_MATCHES} (data.answer_match)")
    response, answer = response.strip(), answer.strip()
    return float(response == answer if match == "exact" else response.endswith(answer))
