"""The demo's toy task, its SFT loop, evaluation and the asset manifest (no full build: that takes minutes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from repo_paths import REPO_ROOT

from recipe_gkd.demo import build_assets, task
from recipe_gkd.demo.evaluate import greedy_accuracy
from recipe_gkd.demo.sft import (
    IGNORE_INDEX,
    SFTConfig,
    batch_order,
    collate,
    encode_example,
    encode_prompt,
    lr_at,
    response_loss,
    sft_train,
)
from recipe_gkd.offline_models import build_char_tokenizer

# The cpu_demo preset's limits (data.max_prompt_length, rollout.sampling.max_new_tokens).
MAX_PROMPT_TOKENS = 32
MAX_NEW_TOKENS = 16
REPO_ASSETS = REPO_ROOT / "assets" / "demo"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return build_char_tokenizer(tmp_path_factory.mktemp("char_tokenizer"))


@pytest.fixture(scope="module")
def default_splits() -> task.Splits:
    return task.generate_splits()


def test_generator_is_deterministic() -> None:
    first = task.generate_splits(seed=7, train_size=300, eval_size=50, dev_size=20)
    again = task.generate_splits(seed=7, train_size=300, eval_size=50, dev_size=20)
    other = task.generate_splits(seed=8, train_size=300, eval_size=50, dev_size=20)
    assert first == again
    assert first.train != other.train


def test_eval_split_does_not_depend_on_train_size() -> None:
    small = task.generate_splits(seed=3, train_size=10, eval_size=40, dev_size=5)
    large = task.generate_splits(seed=3, train_size=1000, eval_size=40, dev_size=5)
    assert small.eval == large.eval
    assert small.dev == large.dev


def test_default_splits_have_their_sizes_and_are_disjoint(default_splits: task.Splits) -> None:
    sizes = (len(default_splits.train), len(default_splits.dev), len(default_splits.eval))
    assert sizes == (task.TRAIN_SIZE, task.DEV_SIZE, task.EVAL_SIZE)
    prompts = [{e.prompt for e in split} for split in (default_splits.train, default_splits.dev, default_splits.eval)]
    assert [len(p) for p in prompts] == list(sizes), "a prompt repeats within a split"
    assert not prompts[0] & prompts[1] and not prompts[0] & prompts[2] and not prompts[1] & prompts[2]


def test_examples_are_well_formed(default_splits: task.Splits) -> None:
    lengths = set()
    for example in default_splits.eval + default_splits.train[:2000]:
        assert example.prompt.startswith(task.PROMPT_PREFIX)
        word = example.prompt.removeprefix(task.PROMPT_PREFIX)
        assert set(word) <= set(task.ALPHABET)
        assert example.answer == example.response == word[::-1]
        lengths.add(len(word))
    assert lengths == set(range(task.MIN_LETTERS, task.MAX_LETTERS + 1))


def test_reward_is_exact_match_after_strip() -> None:
    assert task.reward("edcba", "edcba") == 1.0
    assert task.reward("  edcba\n", "edcba ") == 1.0
    assert task.reward("edcb", "edcba") == 0.0
    assert task.reward("edcbaa", "edcba") == 0.0
    assert task.reward("EDCBA", "edcba") == 0.0
    assert task.reward("", "edcba") == 0.0


def test_prompts_and_responses_fit_the_demo_limits(tokenizer, default_splits: task.Splits) -> None:
    # Token counts depend only on the word length (one token per letter): the eval split and
    # a longest word cover every case; the train words are checked by length.
    examples = [*default_splits.eval, task.make_example("a" * task.MAX_LETTERS)]
    longest_prompt = max(len(encode_prompt(tokenizer, e.prompt)) for e in examples)
    longest_response = max(len(encode_example(tokenizer, e).response_ids) for e in examples)
    assert max(len(e.answer) for e in default_splits.train) == task.MAX_LETTERS
    assert longest_prompt <= MAX_PROMPT_TOKENS
    assert longest_response <= MAX_NEW_TOKENS  # EOS included


def test_jsonl_round_trip(tmp_path: Path) -> None:
    examples = task.generate_splits(seed=1, train_size=5, eval_size=3, dev_size=0).train
    path = task.write_jsonl(tmp_path / "data/train.jsonl", examples)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(set(r) == {"prompt", "response", "answer"} for r in records)
    assert task.read_jsonl(path) == examples
    assert task.read_jsonl(path, limit=2) == examples[:2]


def test_encoding_matches_the_pipeline_and_labels_only_the_response(tokenizer) -> None:
    example = task.make_example("abcdef")
    encoded = encode_example(tokenizer, example)
    chat = [{"role": "user", "content": example.prompt}]
    assert encoded.prompt_ids == list(
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    )
    assert tokenizer.decode(encoded.response_ids) == "fedcba" + tokenizer.eos_token
    short = encode_example(tokenizer, task.make_example("abcde"))
    ids_BL, attention_BL, labels_BL = collate([encoded, short], tokenizer.pad_token_id)
    n_prompt, n_total = len(short.prompt_ids), len(short.prompt_ids) + len(short.response_ids)
    assert labels_BL[1, :n_prompt].eq(IGNORE_INDEX).all()
    assert labels_BL[1, n_prompt:n_total].tolist() == short.response_ids
    assert labels_BL[1, n_total:].eq(IGNORE_INDEX).all() and attention_BL[1, n_total:].eq(0).all()
    assert ids_BL[0].tolist() == encoded.prompt_ids + encoded.response_ids


def test_lr_schedule_and_batch_order() -> None:
    cfg = SFTConfig(steps=100, batch_size=4, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(99, cfg) == pytest.approx(0.1, abs=1e-3)
    batches = batch_order(num_examples=10, steps=5, batch_size=4, seed=0)
    assert len(batches) == 5 and all(len(b) == 4 for b in batches)
    assert len(set(batches[0] + batches[1])) == 8, "an epoch repeats an example"
    assert batches == batch_order(num_examples=10, steps=5, batch_size=4, seed=0)


def test_sft_reduces_the_response_loss(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    examples = task.generate_splits(seed=5, train_size=64, eval_size=0, dev_size=0).train
    probe = collate([encode_example(tokenizer, e) for e in examples[:16]], tokenizer.pad_token_id)
    with torch.no_grad():
        before = response_loss(model, *probe).item()
    # One thread: the matmuls are tiny, and two threads crawl when other jobs share the cores.
    with build_assets.deterministic_torch(threads=1):
        losses = sft_train(model, tokenizer, examples, SFTConfig(steps=12, batch_size=16, lr=3e-3, seed=0))
    with torch.no_grad():
        after = response_loss(model, *probe).item()
    assert len(losses) == 12
    assert after < before - 0.5, (before, after)


def test_sft_stops_when_asked(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    examples = task.generate_splits(seed=5, train_size=16, eval_size=0, dev_size=0).train
    losses = sft_train(model, tokenizer, examples, SFTConfig(steps=10, batch_size=4, lr=1e-3), stop=lambda n: n == 3)
    assert len(losses) == 3


def test_greedy_accuracy_of_a_model_dir(tiny_model_dir: Path, tmp_path: Path) -> None:
    eval_file = task.write_jsonl(tmp_path / "eval.jsonl", task.generate_splits(seed=2, train_size=0, eval_size=5).eval)
    accuracy = greedy_accuracy(tiny_model_dir, eval_file, n=3)
    assert 0.0 <= accuracy <= 1.0  # a random model: the value itself means nothing


def test_deterministic_torch_restores_settings() -> None:
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    with build_assets.deterministic_torch(threads=1):
        assert torch.are_deterministic_algorithms_enabled() and torch.get_num_threads() == 1
    assert (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()) == (threads, deterministic)


def _fake_assets(root: Path) -> None:
    """The asset layout with placeholder files and a manifest of the current recipe."""
    for name in build_assets.REQUIRED_FILES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"placeholder {name}\n")
    manifest = {"recipe": build_assets.recipe(), "files": build_assets.file_table(root)}
    (root / build_assets.MANIFEST).write_text(json.dumps(manifest))


def test_manifest_check_accepts_complete_assets_and_names_what_is_wrong(tmp_path: Path) -> None:
    assert "no " in build_assets.manifest_problem(tmp_path)
    _fake_assets(tmp_path)
    assert build_assets.manifest_problem(tmp_path) is None
    (tmp_path / "teacher/model.safetensors").write_text("changed\n")
    assert "differs" in build_assets.manifest_problem(tmp_path)
    (tmp_path / "teacher/model.safetensors").unlink()
    assert "missing" in build_assets.manifest_problem(tmp_path)


def test_manifest_check_rejects_another_recipe(tmp_path: Path) -> None:
    _fake_assets(tmp_path)
    manifest = json.loads((tmp_path / build_assets.MANIFEST).read_text())
    manifest["recipe"]["build_version"] = -1
    (tmp_path / build_assets.MANIFEST).write_text(json.dumps(manifest))
    assert "recipe" in build_assets.manifest_problem(tmp_path)


def test_build_skips_when_the_manifest_matches(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fake_assets(tmp_path)
    manifest = build_assets.build(tmp_path)
    assert manifest["recipe"] == build_assets.recipe()
    assert "nothing to do" in capsys.readouterr().out


@pytest.mark.slow
def test_built_demo_assets_match_their_manifest_and_accuracies() -> None:
    """The assets in the checkout (when built): intact, teacher accurate, student clearly worse."""
    if not (REPO_ASSETS / build_assets.MANIFEST).is_file():
        pytest.skip(f"no demo assets in {REPO_ASSETS} (python -m recipe_gkd.demo.build_assets builds them)")
    assert build_assets.manifest_problem(REPO_ASSETS) is None
    manifest = json.loads((REPO_ASSETS / build_assets.MANIFEST).read_text())
    eval_file = REPO_ASSETS / "data/eval.jsonl"
    teacher = greedy_accuracy(REPO_ASSETS / "teacher", eval_file)
    student = greedy_accuracy(REPO_ASSETS / "student", eval_file)
    assert teacher == pytest.approx(manifest["teacher"]["eval_accuracy"], abs=0.02)
    assert student == pytest.approx(manifest["student"]["eval_accuracy"], abs=0.02)
    assert teacher >= 0.95
    assert 0.2 <= student <= 0.5


def test_install_built_replaces_the_entries_and_a_failed_build_leaves_them(tmp_path: Path) -> None:
    """The one build-into-a-temporary-directory step of the demo, mixed-student and real-pair builds."""
    out = tmp_path / "assets"
    (out / "student").mkdir(parents=True)
    (out / "student" / "old.bin").write_bytes(b"old")
    (out / build_assets.MANIFEST).write_text("{}")

    def broken(work: Path) -> dict[str, object]:
        (work / "student").mkdir()
        raise RuntimeError("training diverged")

    with pytest.raises(RuntimeError, match="diverged"):
        build_assets.install_built(out, broken, entries=("student",))
    assert (out / "student" / "old.bin").read_bytes() == b"old" and (out / build_assets.MANIFEST).is_file()

    def built(work: Path) -> dict[str, object]:
        (work / "student").mkdir()
        (work / "student" / "model.safetensors").write_bytes(b"new weights")
        return {"student": {"steps": 3}}

    manifest = build_assets.install_built(out, built, entries=("student",))
    assert sorted(p.name for p in (out / "student").iterdir()) == ["model.safetensors"]
    assert not (out / build_assets.MANIFEST).exists(), "the caller writes the new manifest last"
    assert manifest["student"] == {"steps": 3}
    assert manifest["files"] == {
        "student/model.safetensors": {
            "bytes": 11,
            "sha256": build_assets.sha256_file(out / "student/model.safetensors"),
        }
    }
    assert [p.name for p in tmp_path.iterdir()] == ["assets"], "no partial build directory left behind"
