"""Every turn ends where its template ends it: the stop set of real tokenizer shapes, and the HF engine, single- and
multi-turn, sampling nothing after it (tiny students biased to emit the turn end mid-response: tests/support/stop_models.py).

The expected stop ids are written out from the tokens' names, not computed by the code under test. Today's engines
(EOS only) fail these: the Qwen3-Base-shaped student's responses ran on past `<|im_end|>`, the Llama 3.1 one past
`<|eom_id|>`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from stop_models import biased_student

from recipe_gkd.config import ConfigError, load_config
from recipe_gkd.offline_models import build_tiny_causal_lm
from recipe_gkd.stop_set import StopSet, check_turn_ends, stop_set_of

MAX_NEW_TOKENS = 16
PROMPTS = [f"question {i}: add {i} and {2 * i + 1}" for i in range(16)]


def token_id(tokenizer: Any, token: str) -> int:
    return int(tokenizer.convert_tokens_to_ids(token))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stop_models")
    return {
        "qwen3_base": biased_student(root / "qwen3_base", "qwen3_base_bpe", "<|im_end|>"),
        "llama31": biased_student(root / "llama31", "llama31_bpe", "<|eom_id|>"),
        "qwen3_instruct": build_tiny_causal_lm(root / "qwen3_instruct", seed=1, tokenizer_kind="qwen3_instruct_bpe"),
    }


def tokenizer_of(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def test_the_stop_sets_of_real_tokenizer_shapes(models: dict[str, Path]) -> None:
    base = tokenizer_of(models["qwen3_base"])
    stop = stop_set_of(base, models["qwen3_base"], chat_template=True, what="model.student_path")
    # Qwen3-*-Base: EOS <|endoftext|>, generation_config.json's the same, the template closes turns with <|im_end|>.
    assert base.eos_token == "<|endoftext|>"
    assert stop.ids == tuple(sorted({token_id(base, "<|endoftext|>"), token_id(base, "<|im_end|>")}))
    assert (stop.turn_end, stop.closing_id) == (token_id(base, "<|im_end|>"), token_id(base, "<|im_end|>"))
    assert "'<|im_end|>'" in stop.describe() and "the chat template's turn end" in stop.describe()
    # Without the chat template (plain-text prompts) the turn end is not a stop id.
    plain = stop_set_of(base, models["qwen3_base"], chat_template=False, what="model.student_path")
    assert plain.ids == (token_id(base, "<|endoftext|>"),) and plain.closing_id == token_id(base, "<|endoftext|>")

    llama = tokenizer_of(models["llama31"])
    stop = stop_set_of(llama, models["llama31"], chat_template=True, what="model.student_path")
    # Llama 3.1 Instruct: the tokenizer says <|eot_id|>, generation_config.json adds <|end_of_text|> and <|eom_id|>.
    names = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")
    assert stop.ids == tuple(sorted(token_id(llama, n) for n in names))
    assert stop.config_eos == tuple(token_id(llama, n) for n in names)
    assert stop.closing_id == token_id(llama, "<|eot_id|>")


def test_the_end_of_a_response_is_its_first_stop_id() -> None:
    stop = StopSet(eos=2, config_eos=(9,), turn_end=7)
    assert stop.ids == (2, 7, 9)
    assert stop.end([5, 7, 3, 2]) == (2, 7), "up to and including the first stop id"
    assert stop.end([5, 6, 9]) == (3, 9)
    assert stop.end([5, 6, 3]) == (3, None), "cut by the length limit"
    assert StopSet(eos=2, config_eos=(), turn_end=None).closing_id == 2


def hf_engine(student: Path, *overrides: str) -> Any:
    from recipe_gkd.rollout.hf import HFEngine

    cfg = load_config(
        None,
        [
            f"model.student_path={student}",
            "rollout.backend=hf",
            f"rollout.sampling.max_new_tokens={MAX_NEW_TOKENS}",
            *overrides,
        ],
    )
    return HFEngine(cfg)


def chat_prompts(tokenizer: Any) -> list[list[int]]:
    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    return [list(tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=False)) for m in messages]


@pytest.mark.parametrize(("student", "turn_end"), [("qwen3_base", "<|im_end|>"), ("llama31", "<|eom_id|>")])
def test_the_hf_engine_samples_nothing_after_a_stop_id(models: dict[str, Path], student: str, turn_end: str) -> None:
    engine = hf_engine(models[student])
    end = token_id(engine.tokenizer, turn_end)
    assert end != engine.tokenizer.eos_token_id, "the token the student emits is not its tokenizer's EOS"
    generations = engine.generate(chat_prompts(engine.tokenizer), greedy=False, seed=3)
    stop_ids = set(engine.stop.ids)
    for gen in generations:
        body = gen.response_ids[:-1] if gen.stop_id is not None else gen.response_ids
        assert not stop_ids & set(body), f"a token after a stop id: {gen.response_ids}"
        if gen.stop_id is None:
            assert len(gen.response_ids) == MAX_NEW_TOKENS, "only the length limit ends a response without a stop id"
        else:
            assert gen.response_ids[-1] == gen.stop_id
        assert len(gen.logprobs) == len(gen.response_ids)
    mid_way = [g for g in generations if g.stop_id == end and 1 < len(g.response_ids) < MAX_NEW_TOKENS]
    assert len(mid_way) >= 3, "the biased student meets its turn end mid-response"


def test_a_conversation_turn_ends_at_the_turn_end(models: dict[str, Path]) -> None:
    """Multi-turn: each sampled turn stops at its stop id, and the environment reads the text before it."""
    from recipe_gkd.envs import build_environment
    from recipe_gkd.rollout.multi_turn import Limits, MultiTurnRollout

    engine = hf_engine(models["qwen3_base"], "rollout.env=calculator")
    limits = Limits(max_turns=2, max_total_tokens=512, max_new_tokens=MAX_NEW_TOKENS)
    loop = MultiTurnRollout(engine, lambda: build_environment("calculator"), limits, max_prompt_length=256)
    conversations = [loop.start(i, {"prompt": p, "answer": "1"}, seed=i) for i, p in enumerate(PROMPTS)]
    loop.run(conversations, greedy=False, seed=5)
    im_end = token_id(engine.tokenizer, "<|im_end|>")
    stopped = 0
    for conv in conversations:
        sampled = [t for t, s in zip(conv.response_ids, conv.sampled, strict=True) if s]
        # The student's own tokens: none after a stop id within a turn (the first turn: every one here ends on its
        # first reply, no hermes call in a random student's text).
        assert conv.turns == 1 and sampled == conv.response_ids
        length, stop = engine.stop.end(sampled)
        assert length == len(sampled), f"tokens after the stop id {stop}: {sampled}"
        stopped += stop == im_end
        assistant = next(m for m in reversed(conv.messages) if m["role"] == "assistant")
        assert "<|im_end|>" not in assistant["content"], "the environment read the text before the turn end only"
    assert stopped >= 3


def test_a_teacher_that_ends_turns_elsewhere_is_refused_naming_both(models: dict[str, Path], tmp_path: Path) -> None:
    """Base student + Instruct teacher of one vocabulary: both templates close turns with <|im_end|>, accepted. A
    student whose tokenizer ships no chat template ends turns at its EOS (<|endoftext|>): refused."""
    base, instruct = models["qwen3_base"], models["qwen3_instruct"]

    def config(student: Path, *overrides: str) -> Any:
        return load_config(None, [f"model.student_path={student}", f"teacher.model_path={instruct}", *overrides])

    cfg = config(base)
    check_turn_ends(cfg, stop_set_of(tokenizer_of(base), base, chat_template=True, what="model.student_path"))
    bare = tmp_path / "no_template"
    tokenizer = tokenizer_of(base)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(str(bare))
    stop = stop_set_of(tokenizer, base, chat_template=True, what="model.tokenizer_path")
    assert stop.turn_end is None and stop.closing_id == token_id(tokenizer, "<|endoftext|>")
    with pytest.raises(ConfigError) as info:
        check_turn_ends(config(base, f"model.tokenizer_path={bare}"), stop)
    assert info.value.key == "teacher.model_path"
    message = str(info.value)
    assert "'<|im_end|>'" in message and "'<|endoftext|>'" in message and "model.tokenizer_path" in message
