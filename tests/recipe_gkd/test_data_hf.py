"""Hugging Face datasets as data.train_files / data.eval_files: a save_to_disk directory (Dataset, or a
DatasetDict's split), a hub id with its split read offline from the datasets cache, and chat records
whose prompt is a `messages` list with roles."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from recipe_gkd.config import ConfigError, GKDConfig
from recipe_gkd.data import Dataset, check_record_fields, encode_prompt, encode_response, response_text

CHATS = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"question {i}"},
            {"role": "assistant", "content": f"reply {i}"},
        ],
        "answer": f"reply {i}" if i % 3 == 0 else None,
    }
    for i in range(7)
]


def _saved(tmp_path: Path, splits: bool) -> Path:
    import datasets

    data = datasets.Dataset.from_list(CHATS)
    out = tmp_path / ("dict" if splits else "single")
    (datasets.DatasetDict({"train": data, "test": data.select(range(2))}) if splits else data).save_to_disk(str(out))
    return out


def test_a_saved_dataset_directory_reads_like_a_jsonl_file(tmp_path: Path) -> None:
    single = _saved(tmp_path, splits=False)
    dataset = Dataset([str(single)], "data.train_files")
    assert len(dataset) == len(CHATS) and [dataset[i] for i in range(len(CHATS))] == CHATS
    splits = _saved(tmp_path, splits=True)
    assert [Dataset([f"{splits}:test"], "data.eval_files")[i] for i in range(2)] == CHATS[:2]
    both = Dataset([str(single), f"{splits}:test"], "data.train_files")
    assert len(both) == len(CHATS) + 2 and both[len(CHATS) + 1] == CHATS[1]


def test_saved_dataset_errors_name_the_key(tmp_path: Path) -> None:
    splits = _saved(tmp_path, splits=True)
    with pytest.raises(ConfigError, match=r"holds the splits \['test', 'train'\]: name one") as info:
        Dataset([str(splits)], "data.eval_files")
    assert info.value.key == "data.eval_files"
    with pytest.raises(ConfigError, match="holds the splits"):
        Dataset([f"{splits}:validation"], "data.train_files")
    single = _saved(tmp_path, splits=False)
    with pytest.raises(ConfigError, match="single dataset"):
        Dataset([f"{single}:train"], "data.train_files")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="not a datasets save_to_disk directory"):
        Dataset([str(tmp_path / "empty")], "data.train_files")
    with pytest.raises(ConfigError, match="no such data file, directory or hub dataset") as info:
        Dataset([str(tmp_path / "missing.jsonl")], "data.train_files")
    assert info.value.key == "data.train_files"


def test_record_fields_of_a_saved_dataset_are_its_columns(tmp_path: Path) -> None:
    cfg = GKDConfig()
    cfg.data.train_files = [str(_saved(tmp_path, splits=False))]
    cfg.data.prompt_key = "messages"
    check_record_fields(cfg)
    cfg.data.prompt_key = "prompt"
    with pytest.raises(ConfigError, match=r"no field 'prompt' \(fields: \['answer', 'messages'\]\)") as info:
        check_record_fields(cfg)
    assert info.value.key == "data.prompt_key"


def test_a_messages_prompt_goes_through_the_chat_template_without_the_answer(chatml_tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chatml_tokenizer_dir)
    record = CHATS[0]
    ids = encode_prompt(tokenizer, record, "messages", chat_template=True)
    # The reference: the ChatML text written out by hand (the record's own system turn replaces the default).
    text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nquestion 0<|im_end|>\n<|im_start|>assistant\n"
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert response_text(record, "messages") == "reply 0"
    assert encode_response(tokenizer, record, "messages", tokenizer.eos_token_id) == [
        *tokenizer("reply 0", add_special_tokens=False)["input_ids"],
        tokenizer.eos_token_id,
    ]
    with pytest.raises(ConfigError) as info:
        encode_prompt(tokenizer, record, "messages", chat_template=False)
    assert info.value.key == "data.apply_chat_template"
    with pytest.raises(ConfigError, match="message 1 is not") as info:
        encode_prompt(tokenizer, {"messages": [{"role": "user", "content": "a"}, "b"]}, "messages", chat_template=True)
    assert info.value.key == "data.prompt_key"
    with pytest.raises(ConfigError, match="no message before the assistant's"):
        encode_prompt(tokenizer, {"m": [{"role": "assistant", "content": "a"}]}, "m", chat_template=True)


HUB_READER = """
import json, sys
from recipe_gkd.data import Dataset
dataset = Dataset([sys.argv[1]], "data.train_files")
print(json.dumps([dataset[i] for i in range(len(dataset))]))
"""


def _hub_dataset_in_cache(cache: Path, repo: str, split: str, work: Path) -> None:
    """Lay out the datasets cache as a download of hub dataset `repo` leaves it (its Arrow files, prepared)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.packaged_modules.parquet.parquet import Parquet

    source = work / f"{split}.parquet"
    pq.write_table(pa.Table.from_pylist(CHATS), source)
    name = repo.split("/")[-1]
    builder = Parquet(
        cache_dir=str(work / "build"), dataset_name=name, config_name="default", data_files={split: str(source)}
    )
    builder.download_and_prepare()
    # <cache>/<org>___<name>/<config>/<version>/<hash>/: what load_dataset(repo) reads when offline.
    target = cache / repo.replace("/", "___") / "default" / "0.0.0" / "0123456789abcdef"
    target.mkdir(parents=True)
    for file in ("dataset_info.json", f"{name}-{split}.arrow"):
        shutil.copy(Path(builder.cache_dir) / file, target / file)


@pytest.mark.slow
def test_a_hub_dataset_with_its_split_is_read_offline_from_the_cache(tmp_path: Path) -> None:
    cache = tmp_path / "datasets_cache"
    _hub_dataset_in_cache(cache, "tiny/chats", "train", tmp_path)
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    run = [sys.executable, "-c", HUB_READER]
    proc = subprocess.run([*run, "tiny/chats:train"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == CHATS
    proc = subprocess.run([*run, "tiny/absent:train"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "data.train_files" in last and "HF_DATASETS_OFFLINE=1" in last and "tiny/absent:train" in last, last
