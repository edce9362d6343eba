"""A teacher prompt of its own per record (recipe_gkd/teacher_prompt.py): the rules, the join on a real-shaped ChatML
tokenizer (default system prompt, eos == pad, split UTF-8 characters), the bound (refused, never cut), several
teachers each with its own rule, and the teacher's prompt counted where the teacher's sequences are sized."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from recipe_gkd.config import CONFIG_DIR, ConfigError, load_config
from recipe_gkd.config.rules import teacher_longest_sequence
from recipe_gkd.config.teachers import teacher_handles, teacher_views
from recipe_gkd.data import check_record_fields
from recipe_gkd.offline_models import CHATML_DEFAULT_SYSTEM, IM_END, IM_START
from recipe_gkd.rollout.teacher_set import TeacherSet
from recipe_gkd.targets import build_target
from recipe_gkd.teacher_prompt import FieldPrompt, StudentPrompt, TemplatePrompt
from teacher_server.wire.protocol import TeacherScores

DEMO = CONFIG_DIR / "presets" / "cpu_demo.yaml"
TWO = CONFIG_DIR / "presets" / "cpu_two_teachers.yaml"


def chatml(user: str, system: str = CHATML_DEFAULT_SYSTEM) -> str:
    return f"{IM_START}system\n{system}{IM_END}\n{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n"


@pytest.fixture(scope="module")
def tokenizer(chatml_tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chatml_tokenizer_dir)


def test_the_rule_is_chosen_once_per_teacher_from_its_section_then_data() -> None:
    cfg = load_config(DEMO)
    assert isinstance(teacher_handles(cfg)["default"].prompt, StudentPrompt)
    cfg = load_config(DEMO, ["data.teacher_prompt_key=hint"])
    rule = teacher_handles(cfg)["default"].prompt
    assert (
        isinstance(rule, FieldPrompt)
        and rule.key == "data.teacher_prompt_key"
        and rule.record_fields() == {"hint": "data.teacher_prompt_key"}
    )
    cfg = load_config(TWO, ["teachers.sum.prompt_template='{prompt} hint: {hint}'", "data.teacher_prompt_key=solution"])
    handles = teacher_handles(cfg)
    assert (
        isinstance(handles["sum"].prompt, TemplatePrompt)
        and handles["sum"].prompt.key == "teachers.sum.prompt_template"
    )
    assert isinstance(handles["reverse"].prompt, FieldPrompt) and handles["reverse"].prompt.field == "solution"


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["data.teacher_prompt_key=a", "data.teacher_prompt_template='{prompt} {a}'"], "data.teacher_prompt_template"),
        (["data.teacher_prompt_template='{prompt} {0}'"], "data.teacher_prompt_template"),
        (["data.teacher_prompt_template='{prompt} {a:>3}'"], "data.teacher_prompt_template"),
        (["data.teacher_prompt_template='no field'"], "data.teacher_prompt_template"),
        (["data.teacher_prompt_key=hint", "teacher.model_path=''"], "teacher.model_path"),
        # The teacher's sequences are its own prompt's bound + the response: max_model_len must hold them.
        (
            ["data.teacher_prompt_key=hint", "data.max_teacher_prompt_length=600", "teacher.max_model_len=601"],
            "teacher.max_model_len",
        ),
    ],
)
def test_bad_rules_name_their_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(DEMO, overrides)
    assert info.value.key == key, info.value


def test_the_same_max_model_len_holds_the_students_prompt() -> None:
    load_config(DEMO, ["data.max_teacher_prompt_length=600", "teacher.max_model_len=601"])  # the bound is not read


def test_a_teachers_own_rule_is_named_under_teachers() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(TWO, ["teachers.sum.prompt_key=a", "teachers.sum.prompt_template='{prompt} {a}'"])
    assert info.value.key == "teachers.sum.prompt_template"


def test_the_longest_teacher_sequence_is_its_own_prompt_bound_plus_the_response() -> None:
    cfg = load_config(DEMO, ["data.max_prompt_length=32", "rollout.sampling.max_new_tokens=16"])
    assert teacher_longest_sequence(cfg) == (48, "data.max_prompt_length")
    cfg = load_config(
        DEMO,
        [
            "data.max_prompt_length=32",
            "rollout.sampling.max_new_tokens=16",
            "data.teacher_prompt_key=hint",
            "data.max_teacher_prompt_length=100",
        ],
    )
    assert teacher_longest_sequence(cfg) == (116, "data.max_teacher_prompt_length")
    # Under teachers:, each teacher by its own rule (a view per teacher).
    cfg = load_config(TWO, ["teachers.sum.prompt_key=hint", "data.max_teacher_prompt_length=100"])
    views = teacher_views(cfg)
    longest = {name: teacher_longest_sequence(view)[0] for name, view in views.items()}
    new = cfg.rollout.sampling.max_new_tokens
    assert longest == {"reverse": cfg.data.max_prompt_length + new, "sum": 100 + new}


def test_the_join_renders_the_teachers_chat_template_and_keeps_the_response_exactly(tokenizer: Any) -> None:
    rule = TemplatePrompt("data.teacher_prompt_template", "prompt", True, "{prompt}\n\nReference solution: {solution}")
    record = {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "rev:héllo"}],
        "solution": "olléh ✓",
    }
    student_prompt = tokenizer.apply_chat_template(record["prompt"], add_generation_prompt=True, return_dict=False)
    # A response the student sampled: any ids, a split UTF-8 character's pieces and the EOS (== pad) included.
    response = [*tokenizer("olé ✓", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    sequence = np.asarray([*student_prompt, *response], dtype=np.int32)
    joined, start = rule.join(lambda: (tokenizer, None), record, sequence, len(student_prompt), "record 0", 200)
    expected = tokenizer(chatml("rev:héllo\n\nReference solution: olléh ✓", "Be brief."), add_special_tokens=False)
    assert joined[:start].tolist() == expected["input_ids"], (
        "its own system turn survives; the generation prompt ends it"
    )
    assert joined[start:].tolist() == response
    # A string prompt gets the template's default system turn.
    joined, start = rule.join(
        lambda: (tokenizer, None), {"prompt": "rev:ab", "solution": "ba"}, sequence, len(student_prompt), "r", 200
    )
    expected = tokenizer(chatml("rev:ab\n\nReference solution: ba"), add_special_tokens=False)["input_ids"]
    assert joined[:start].tolist() == expected and joined[start:].tolist() == response


def test_a_teacher_prompt_over_its_bound_is_refused_never_cut(tokenizer: Any) -> None:
    rule = FieldPrompt("data.teacher_prompt_key", "prompt", True, "hint")
    record = {"prompt": "rev:ab", "hint": "the answer is ba " * 20}
    length = len(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": record["hint"]}], add_generation_prompt=True, return_dict=False
        )
    )
    long_response = np.arange(5, 305, dtype=np.int32)  # a response longer than the bound: never cut
    sequence = np.concatenate([np.asarray([1, 2, 3], dtype=np.int32), long_response])
    with pytest.raises(
        ConfigError, match=rf"max_teacher_prompt_length`: record 7: .* has {length} tokens > {length - 1}"
    ):
        rule.join(lambda: (tokenizer, None), record, sequence, 3, "record 7", length - 1)
    joined, start = rule.join(lambda: (tokenizer, None), record, sequence, 3, "record 7", length)
    assert start == length and joined[start:].tolist() == long_response.tolist()


def test_a_record_without_the_field_names_the_key_and_the_record(tokenizer: Any) -> None:
    rule = TemplatePrompt("teachers.sum.prompt_template", "prompt", True, "{prompt} {solution}")
    with pytest.raises(ConfigError) as info:
        rule.join(lambda: (tokenizer, None), {"prompt": "x"}, np.zeros(4, np.int32), 2, "record 3 of train.jsonl", 99)
    assert info.value.key == "teachers.sum.prompt_template" and "record 3 of train.jsonl" in str(info.value)


def test_check_record_fields_reads_every_local_record_for_the_teachers_fields(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [{"prompt": "a", "hint": "h"}, {"prompt": "b"}]))
    base = [f"data.train_files=[{data}]", "data.eval_files=[]", "trainer.eval_every=0"]
    check_record_fields(load_config(DEMO, base))  # no rule: the field is not read
    with pytest.raises(ConfigError) as info:
        check_record_fields(load_config(DEMO, [*base, "data.teacher_prompt_key=hint"]))
    assert info.value.key == "data.teacher_prompt_key" and f"record 1 of {data}" in str(info.value)


class Recording:
    """A teacher that records what it was asked and answers one row per scored position."""

    def __init__(self) -> None:
        self.asked: list[tuple[list[int], int]] = []

    def score(self, sequences: list[np.ndarray], score_from: list[int]) -> list[TeacherScores]:
        self.asked += [(s.tolist(), f) for s, f in zip(sequences, score_from, strict=True)]
        return [
            TeacherScores(
                topk_logprobs=np.zeros((len(s) - f, 1), np.float32),
                topk_ids=np.zeros((len(s) - f, 1), np.int32),
                tail_logmass=np.zeros(len(s) - f, np.float32),
                sampled_logprob=np.arange(len(s) - f, dtype=np.float32),
            )
            for s, f in zip(sequences, score_from, strict=True)
        ]


def test_several_teachers_each_get_their_own_prompt(tokenizer: Any, chatml_tokenizer_dir: Path) -> None:
    cfg = load_config(
        TWO,
        [
            f"teachers.reverse.model_path={chatml_tokenizer_dir}",
            f"teachers.sum.model_path={chatml_tokenizer_dir}",
            "teachers.sum.prompt_key=hint",
            "data.max_teacher_prompt_length=100",
        ],
    )
    scorers = {"reverse": Recording(), "sum": Recording()}
    teachers = TeacherSet(cfg, build_target(cfg), scorers, tokenizer)
    try:
        records = [{"prompt": "rev:ab", "teacher": "reverse"}, {"prompt": "sum:12", "teacher": "sum", "hint": "=3"}]
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, return_dict=False
            )
            for r in records
        ]
        responses = [[7, 8, 9], [10, tokenizer.eos_token_id]]
        sequences = [np.asarray(p + r, np.int32) for p, r in zip(prompts, responses, strict=True)]
        starts = [len(p) for p in prompts]
        scored = teachers.score(["reverse", "sum"], sequences, starts, [None, None], records, ["r0", "r1"])
    finally:
        teachers.close()
    assert scorers["reverse"].asked == [(sequences[0].tolist(), starts[0])], "no rule: the student's own ids"
    hint = tokenizer(chatml("=3"), add_special_tokens=False)["input_ids"]
    assert scorers["sum"].asked == [(hint + responses[1], len(hint))]
    assert [len(s.sampled_logprob) for s in scored] == [3, 2], "one row per response token, in order"


def test_the_openai_route_sends_the_joined_ids_and_scores_from_the_join(
    scripted: tuple[str, list[tuple[int, object]], list[dict]], tokenizer: Any, chatml_tokenizer_dir: Path
) -> None:
    """teacher.backend=openai: the client sends the teacher's prompt + the student's response as the token-id prompt
    and reads the prompt log-probs from the join on (a scripted vLLM /v1/completions answer)."""
    from openai_script import MODELS, completions

    from teacher_server.client.openai_client import OpenAITeacherClient

    address, script, seen = scripted
    vocab = len(tokenizer)
    rng = np.random.default_rng(0)
    record = {"prompt": "rev:abc", "hint": "the answer is cba"}
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": record["prompt"]}], add_generation_prompt=True, return_dict=False
    )
    response = [*tokenizer("cba", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    hint = tokenizer(chatml(record["hint"]), add_special_tokens=False)["input_ids"]
    joined = hint + response
    logits = rng.normal(size=(len(joined), vocab))
    full = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    probe = (200, completions({(0, 0): full[:2]}))
    script += [MODELS, probe, (200, completions({tuple(joined): full}))]
    client = OpenAITeacherClient(address, top_k=2, max_inflight=1, api_key="k", model_path=str(chatml_tokenizer_dir))
    client.connect()
    overrides = ["data.teacher_prompt_key=hint", "data.max_teacher_prompt_length=64"]
    cfg = load_config(DEMO, [*overrides, f"teacher.model_path={chatml_tokenizer_dir}"])
    teachers = TeacherSet(cfg, build_target(cfg), {"default": client}, tokenizer)
    try:
        sequence = np.asarray(prompt + response, np.int32)
        (scored,) = teachers.score(["default"], [sequence], [len(prompt)], [None], [record], ["record 0"])
    finally:
        teachers.close()
    assert seen[-1]["body"]["prompt"] == [joined]
    # Row i: the teacher's log-prob of response token i, predicted at the join + i.
    np.testing.assert_allclose(scored.sampled_logprob, full[len(hint) + np.arange(len(response)), response], atol=1e-6)


class RecordingText:
    """A teacher of another tokenizer in this process: the replica's Renderer, keeping what it rendered."""

    def __init__(self, renderer: Any) -> None:
        self.renderer = renderer
        self.rendered: list[tuple[Any, Any]] = []

    def score_conversations(self, conversations: list[Any]) -> list[TeacherScores]:
        import dataclasses

        from teacher_server.wire.protocol import scores_from_logprobs

        out = []
        for conversation in conversations:
            r = self.renderer.render(conversation)
            self.rendered.append((conversation, r))
            rng = np.random.default_rng(len(r.ids))
            logits = rng.normal(size=(len(r.ids) - r.score_from, len(self.renderer.tokenizer)))
            logprobs = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
            scored = scores_from_logprobs(logprobs, r.ids[r.score_from :], 4)
            out.append(dataclasses.replace(scored, token_ids=r.ids[r.score_from :], byte_offsets=r.byte_offsets))
        return out


def test_across_tokenizers_the_teacher_renders_its_own_prompt_in_its_own_template() -> None:
    """algorithm.cross_tokenizer: the teacher's prompt goes as the conversation's prompt, rendered by the teacher's
    chat template (a Llama-3-shaped BPE teacher, the demo's char-tokenizer student); the response is the student's."""
    from transformers import AutoTokenizer

    from recipe_gkd.config import REPO_ROOT
    from recipe_gkd.cross_tokenizer.route import CrossTokenizerScorer
    from recipe_gkd.data import encode_prompt
    from teacher_server.wire.conversation import Renderer

    teacher_dir, student_dir = REPO_ROOT / "assets" / "demo_xtok" / "teacher", REPO_ROOT / "assets" / "demo" / "student"
    if not teacher_dir.is_dir() or not student_dir.is_dir():
        pytest.skip("the demo's assets are not built (make demo builds them)")
    teacher_tok, student = AutoTokenizer.from_pretrained(teacher_dir), AutoTokenizer.from_pretrained(student_dir)
    cfg = load_config(
        None,
        [
            "algorithm.cross_tokenizer=span",
            "teacher.top_k=4",
            f"teacher.model_path={teacher_dir}",
            "data.teacher_prompt_template='{prompt} hint: {solution}'",
            "data.max_teacher_prompt_length=64",
        ],
    )
    text_teacher = RecordingText(Renderer(teacher_tok))
    scorer = CrossTokenizerScorer(text_teacher, student, teacher_tok, 4, cfg.data)
    teachers = TeacherSet(cfg, build_target(cfg), {"default": scorer}, student)
    record = {"prompt": "rev:abc", "solution": "cba"}
    prompt = encode_prompt(student, record, "prompt", True)
    response = [*student("cba", add_special_tokens=False)["input_ids"], student.eos_token_id]
    sequence = np.asarray(prompt + response, np.int32)
    try:
        (scored,) = teachers.score(["default"], [sequence], [len(prompt)], [None], [record], ["record 0"])
    finally:
        teachers.close()
    ((conversation, rendered),) = text_teacher.rendered
    assert conversation.messages == [{"role": "user", "content": "rev:abc hint: cba"}]
    assert conversation.response == "cba" and conversation.end_of_turn
    own = teacher_tok.apply_chat_template(conversation.messages, add_generation_prompt=True, return_dict=False)
    assert rendered.ids[: rendered.score_from].tolist() == own, "the teacher's own template and generation prompt"
    assert len(scored.sampled_logprob) == len(response), "one row per student response token"


def test_the_teachers_held_out_prompt_with_its_privileged_context(tokenizer: Any, chatml_tokenizer_dir: Path) -> None:
    """What the teacher's held-out accuracy from its own prompt generates from: its rule's prompt, its template."""
    from recipe_gkd.teacher_prompt import own_prompt_encoder

    cfg = load_config(DEMO, ["data.teacher_prompt_template='{prompt} hint: {solution}'"])
    encode = own_prompt_encoder(teacher_handles(cfg)["default"], cfg.data)
    ids = encode(tokenizer, {"prompt": "rev:ab", "solution": "ba"})
    assert ids == tokenizer(chatml("rev:ab hint: ba"), add_special_tokens=False)["input_ids"]
    plain = own_prompt_encoder(teacher_handles(load_config(DEMO))["default"], cfg.data)
    assert plain(tokenizer, {"prompt": "rev:ab"}) == tokenizer(chatml("rev:ab"), add_special_tokens=False)["input_ids"]


def test_the_privileged_demo_data_is_the_demos_without_the_instruction(tmp_path: Path) -> None:
    """configs/presets/cpu_privileged.yaml's data: the demo's records, the student's prompt without `rev:`; its
    teacher prompt template puts the instruction back, so the teacher sees exactly the demo's prompt."""
    from recipe_gkd.config import REPO_ROOT
    from recipe_gkd.demo.privileged import build

    demo = tmp_path / "demo"
    demo.mkdir()
    rows = [{"prompt": "rev:abcde", "answer": "edcba", "response": "edcba"}, {"prompt": "rev:xy", "answer": "yx"}]
    for name in ("train.jsonl", "eval.jsonl"):
        (demo / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, _ = build(tmp_path / "out", demo)
    built = [json.loads(line) for line in train.read_text().splitlines()]
    assert built == [{**r, "prompt": r["prompt"][4:]} for r in rows]
    cfg = load_config(REPO_ROOT / "configs" / "presets" / "cpu_privileged.yaml")
    rule = teacher_handles(cfg)["default"].prompt
    assert [rule.value(b, "r") for b in built] == [r["prompt"] for r in rows]


def test_a_resumed_run_must_keep_its_teachers_prompt() -> None:
    """The teacher's prompt rule is part of what a checkpoint's config must match; a run without one keeps the hash
    its checkpoints were saved with."""
    from recipe_gkd.runtime.checkpoint import SEMANTIC_KEYS, semantic_config

    plain = semantic_config(load_config(DEMO))
    assert all(any(k == s or k.startswith(f"{s}.") for s in SEMANTIC_KEYS) for k in plain)
    hinted = semantic_config(load_config(DEMO, ["data.teacher_prompt_key=hint"]))
    assert hinted == {**plain, "data.teacher_prompt_key": "record field 'hint'"}
    other = semantic_config(load_config(DEMO, ["data.teacher_prompt_key=solution"]))
    assert other != hinted
