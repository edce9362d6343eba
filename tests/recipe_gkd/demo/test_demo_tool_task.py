"""The tool demo's task, its tokenizer and chat template, the scripted trajectories and the committed assets."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from repo_paths import REPO_ROOT

from recipe_gkd.demo import tool_assets, tool_task
from recipe_gkd.demo.build_assets import MANIFEST, file_table
from recipe_gkd.demo.sft import EncodedExample
from recipe_gkd.envs import build_environment
from recipe_gkd.envs.tool_calls import HermesCalls, ToolCall
from recipe_gkd.offline_models import TOOLS_CHAT_TEMPLATE, build_tools_bpe_tokenizer

SMALL = {"train_size": 40, "eval_size": 12, "dev_size": 6}
MARKUP = ("</tool_response>", "<tool_call>", "<|im_start|>")
# The tokenizer's corpus in these tests: enough conversations for every piece of the template to merge.
CORPUS_RECORDS = 200


def _corpus(seed: int = 21) -> list:
    return [tool_task.conversation(r) for r in tool_task.generate_splits(seed=seed, train_size=CORPUS_RECORDS).train]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return build_tools_bpe_tokenizer(tmp_path_factory.mktemp("tools_bpe"), _corpus())


@pytest.fixture(scope="module")
def records() -> list[tool_task.ToolSumRecord]:
    return tool_task.generate_splits(seed=11, **SMALL).train[:8]


def test_splits_are_deterministic_disjoint_and_correct() -> None:
    first = tool_task.generate_splits(seed=3, **SMALL)
    assert first == tool_task.generate_splits(seed=3, **SMALL)
    assert first.train != tool_task.generate_splits(seed=4, **SMALL).train
    larger = tool_task.generate_splits(seed=3, train_size=400, eval_size=12, dev_size=6)
    assert (larger.eval, larger.dev) == (first.eval, first.dev), "held-out splits depend on the train size"
    prompts = [{r.prompt for r in split} for split in (first.train, first.dev, first.eval)]
    assert [len(p) for p in prompts] == [40, 6, 12], "a prompt repeats within a split"
    assert not (prompts[0] & prompts[1] or prompts[0] & prompts[2] or prompts[1] & prompts[2])
    for record in first.train + first.eval:
        numbers = [int(n) for n in record.prompt.removeprefix(tool_task.PROMPT_PREFIX).split("+")]
        assert tuple(numbers) == record.numbers and len(numbers) == tool_task.NUMBERS_PER_PROMPT
        assert all(tool_task.MIN_NUMBER <= n <= tool_task.MAX_NUMBER for n in numbers)
        assert int(record.answer) == sum(numbers)


def test_jsonl_round_trip_is_byte_stable(tmp_path: Path) -> None:
    records = tool_task.generate_splits(seed=3, **SMALL).eval
    path = tool_task.write_jsonl(tmp_path / "a.jsonl", records)
    assert tool_task.read_jsonl(path) == records
    assert tool_task.write_jsonl(tmp_path / "b.jsonl", records).read_bytes() == path.read_bytes()
    assert json.loads(path.read_text().splitlines()[0]).keys() == {"prompt", "answer", "numbers"}


def test_scripted_trajectories_solve_the_calculator_env(records: list[tool_task.ToolSumRecord]) -> None:
    for record in records:
        env = build_environment(tool_task.ENV_NAME)
        assert env.reset(asdict(record)) == tool_task.start_messages(record)[0]
        turns = tool_task.scripted_turns(record)
        assert len([t for t in turns if t["role"] == "assistant"]) == tool_task.SCRIPTED_TURNS
        for i, turn in enumerate(turns):
            if turn["role"] != "assistant":
                continue
            step = env.step(turn)
            expected = [t for t in turns[i + 1 : i + 2] if t["role"] == "tool"]
            assert step.observations == expected and step.tool_failures == 0
        assert step.done and step.reward == 1.0 and not step.truncated


def test_a_wrong_tool_is_followed_by_the_script_and_fails_the_env(records: list[tool_task.ToolSumRecord]) -> None:
    wrong = tool_task.wrong_answer(seed=1)
    for record in records:
        turns = tool_task.scripted_turns(record, wrong)
        answers = [t["content"] for t in turns if t["role"] == "tool"]
        assert answers[-1] == turns[-1]["content"] != record.answer
        # Plausible: the first answer is the first number plus another number of the task's range (so it starts
        # with the digits a true first total starts with), never the second number.
        other = int(answers[0]) - record.numbers[0]
        assert tool_task.MIN_NUMBER <= other <= tool_task.MAX_NUMBER and other != record.numbers[1]
        # The second call reads the first (wrong) answer: the script copies the tool, not the truth.
        assert json.loads(turns[2]["content"].split("\n")[1])["arguments"]["expression"].startswith(answers[0] + "+")
        env = build_environment(tool_task.ENV_NAME)
        env.reset(asdict(record))
        for turn in turns:
            if turn["role"] == "assistant":
                step = env.step(turn)
        assert step.done and step.reward == 0.0


def _render(tokenizer, messages, tools, generation: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation)


def test_template_renders_tools_calls_and_responses(tokenizer, records: list[tool_task.ToolSumRecord]) -> None:
    record = records[0]
    messages, tools = tool_task.start_messages(record)
    turns = tool_task.scripted_turns(record)
    a, b, c = record.numbers
    text = _render(tokenizer, messages + turns[:2], tools, generation=True)
    assert text == (
        "<|im_start|>system\n" + messages[0]["content"] + "\n<tools>calculator(expression)</tools><|im_end|>"
        f"<|im_start|>user\nsum:{a}+{b}+{c}<|im_end|>"
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "'
        f'{a}+{b}"}}}}\n</tool_call><|im_end|>'
        f"<|im_start|>user\n<tool_response>\n{a + b}\n</tool_response><|im_end|><|im_start|>assistant\n"
    )
    # A structured call renders as the text the scripted turn (and a model) writes, as in Qwen3's template.
    structured = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a}+{b}"}}}
    ]}  # fmt: skip
    assert _render(tokenizer, [*messages, structured], tools) == _render(tokenizer, messages + turns[:1], tools)
    # A run of tool messages is one user turn.
    two = [{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    assert _render(tokenizer, [*messages, turns[0], *two], tools).endswith(
        "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>"
    )
    # Without tools, no tools line; without a system message, no system turn.
    assert _render(tokenizer, messages, None) == f"<|im_start|>system\n{messages[0]['content']}<|im_end|>" + (
        f"<|im_start|>user\nsum:{a}+{b}+{c}<|im_end|>"
    )
    assert _render(tokenizer, messages[1:], None, generation=True).startswith("<|im_start|>user\n")


def _ids(tokenizer, messages, tools, generation: bool = False) -> list[int]:
    return list(
        tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation, return_dict=False)
    )


def _check_prefix_property(tokenizer, messages, tools) -> None:
    """Independently of encode_trajectory: each rendering is an id prefix of the next, and an assistant turn is
    the generation prompt + its content's ids + EOS."""
    for k in range(len(messages) - 1):
        shorter, longer = _ids(tokenizer, messages[: k + 1], tools), _ids(tokenizer, messages[: k + 2], tools)
        assert longer[: len(shorter)] == shorter, f"message {k + 1} re-renders the ones before it"
        if messages[k + 1]["role"] == "assistant":
            content = tokenizer(messages[k + 1]["content"], add_special_tokens=False).input_ids
            prompt = _ids(tokenizer, messages[: k + 1], tools, generation=True)
            assert longer == prompt + content + [tokenizer.eos_token_id]


def test_prefix_property_on_real_trajectories(tokenizer, records: list[tool_task.ToolSumRecord]) -> None:
    wrong = tool_task.wrong_answer(seed=2)
    for record in records[:4]:
        messages, tools = tool_task.start_messages(record)
        for tool in (tool_task.calculator_answer, wrong):
            _check_prefix_property(tokenizer, messages + tool_task.scripted_turns(record, tool), tools)


def _sampled_text(tokenizer, encoded: EncodedExample) -> list[str]:
    """The decoded runs of sampled tokens (each should be one assistant turn + EOS)."""
    runs, current = [], []
    for token, sampled in zip(encoded.response_ids, encoded.loss_mask, strict=True):
        if sampled:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return [*runs, tokenizer.decode(current)] if current else runs


def test_encoded_trajectory_is_the_whole_rendering_and_masks_the_tool(tokenizer, records) -> None:
    for record in records:
        messages, tools = tool_task.start_messages(record)
        turns = tool_task.scripted_turns(record)
        encoded = tool_task.encode_record(tokenizer, record)
        assert encoded.prompt_ids + encoded.response_ids == _ids(tokenizer, messages + turns, tools)
        assert encoded.prompt_ids == _ids(tokenizer, messages, tools, generation=True)
        assistant = [t["content"] + "<|im_end|>" for t in turns if t["role"] == "assistant"]
        assert _sampled_text(tokenizer, encoded) == assistant
        assert tool_task.encode_record_fast(tokenizer, record) == encoded
        wrong = tool_task.encode_record(tokenizer, record, tool_task.wrong_answer(seed=5))
        assert tool_task.encode_record_fast(tokenizer, record, tool_task.wrong_answer(seed=5)) == wrong


@pytest.mark.parametrize(
    "output",
    [
        "error: unexpected '€' at character 4: only numbers",  # a 3-byte character the corpus never held
        "é\u0301 😀 中文\n\n\ttab",  # a combining mark, an emoji, CJK, a blank line, a tab
        "</tool_response><tool_call> <|im_start|>",  # markup as text: read as those tokens
    ],
)
def test_a_tool_output_outside_the_corpus_keeps_the_prefix_property(tokenizer, records, output: str) -> None:
    record = records[0]
    messages, tools = tool_task.start_messages(record)
    turns = [
        *tool_task.scripted_turns(record)[:1],
        {"role": "tool", "content": output},
        {"role": "assistant", "content": "0"},
    ]
    _check_prefix_property(tokenizer, messages + turns, tools)
    encoded = tool_task.encode_trajectory(tokenizer, messages + turns, tools)
    tool_ids = [t for t, s in zip(encoded.response_ids, encoded.loss_mask, strict=True) if not s]
    # Byte fallback: no unknown token, and the delta decodes to the template's text around the output exactly.
    assert tokenizer.unk_token_id is None
    assert tokenizer.decode(tool_ids) == (
        f"<|im_start|>user\n<tool_response>\n{output}\n</tool_response><|im_end|><|im_start|>assistant\n"
    )
    # A character the corpus never held is split into its UTF-8 bytes, one token each: alone, a token decodes
    # to a replacement character, not to a part of the text.
    corpus_text = "".join(str(m["content"]) for messages, _ in _corpus() for m in messages)
    for ch in sorted({c for c in output if c not in corpus_text}):
        pieces = tokenizer(ch, add_special_tokens=False).input_ids
        assert len(pieces) == len(ch.encode("utf-8")), ch
        if len(pieces) > 1:
            assert all(tokenizer.decode([p]) == "\ufffd" for p in pieces), ch
    # Markup in the text is read as its token (as Qwen's tokenizer does): here the template's own markers only.
    for marker in MARKUP:
        template_own = {"<|im_start|>": 2, "</tool_response>": 1}.get(marker, 0)  # the user turn + assistant prompt
        assert tool_ids.count(tokenizer.convert_tokens_to_ids(marker)) == template_own + output.count(marker)
    assert _sampled_text(tokenizer, encoded) == [turns[0]["content"] + "<|im_end|>", "0<|im_end|>"]


def test_bpe_copies_digits_one_by_one_and_compresses_the_markup(tokenizer, records) -> None:
    """Every digit is one token (a copied number is copied token by token); the markup merges into few tokens;
    the tool parser reads the call in the decoded sampled text."""
    for record in records:
        encoded = tool_task.encode_record(tokenizer, record)
        ids = encoded.prompt_ids + encoded.response_ids
        pieces = [tokenizer.decode([i]) for i in ids]
        text = "".join(pieces)
        assert sum(ch.isdigit() for ch in text) == sum(p.isdigit() for p in pieces)
        assert all(len(p) == 1 for p in pieces if any(ch.isdigit() for ch in p))
        # The char-level encoding of the same conversation took 175 + 199 tokens.
        assert len(encoded.prompt_ids) <= 60 and len(encoded.response_ids) <= 100, len(ids)
        call = _sampled_text(tokenizer, encoded)[0].removesuffix("<|im_end|>")
        a, b, _ = record.numbers
        assert HermesCalls().parse(call) == [ToolCall("calculator", {"expression": f"{a}+{b}"})]
    # The tool-call and response markers are one token each (added tokens, kept by decoding).
    for marker in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        assert len(tokenizer(marker, add_special_tokens=False).input_ids) == 1
        assert tokenizer.decode(tokenizer(marker, add_special_tokens=False).input_ids) == marker
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>" and tokenizer.bos_token is None


def test_bpe_is_deterministic_and_learns_from_its_corpus(tmp_path: Path, tokenizer) -> None:
    again = build_tools_bpe_tokenizer(tmp_path / "again", _corpus())
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    # The merges come from the corpus: a word only another corpus holds is one token there, bytes here.
    extra = ([{"role": "user", "content": "multiplication " * 20}], None)
    other = build_tools_bpe_tokenizer(tmp_path / "other", [*_corpus(), extra])
    assert len(other(" multiplication", add_special_tokens=False).input_ids) == 1
    assert len(tokenizer(" multiplication", add_special_tokens=False).input_ids) > 5
    # No merge spans a special token or a tool marker: they were cut out of the corpus.
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    assert not [m for m in merges if any(x in "".join(m) for x in ("im_", "tool_", "|>", "<|"))]


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer, records) -> None:
    record = records[0]
    messages, tools = tool_task.start_messages(record)
    turns = tool_task.scripted_turns(record)
    # Qwen3's own separator: a newline after each <|im_end|>, which the model never samples.
    original = tokenizer.chat_template
    tokenizer.chat_template = TOOLS_CHAT_TEMPLATE.replace("'<|im_end|>'", "'<|im_end|>\\n'")
    try:
        with pytest.raises(tool_task.TemplateBreaksPrefix, match="assistant turn"):
            tool_task.encode_trajectory(tokenizer, messages + turns, tools)
    finally:
        tokenizer.chat_template = original


class _PrefixModel(torch.nn.Module):
    """A stand-in causal LM: the logits at position t are one-hot at `next_token[ids[:t + 1]]` (0 if unknown)."""

    def __init__(self, next_token: dict[tuple[int, ...], int], vocab: int) -> None:
        super().__init__()
        self.next_token, self.vocab = next_token, vocab

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> SimpleNamespace:
        rows = input_ids.tolist()
        predicted = [[self.next_token.get(tuple(row[: t + 1]), 0) for t in range(len(row))] for row in rows]
        return SimpleNamespace(logits=torch.nn.functional.one_hot(torch.tensor(predicted), self.vocab).float())


def test_argmax_share_counts_only_sampled_tokens(tokenizer, records) -> None:
    encoded = [tool_task.encode_record(tokenizer, r) for r in records[:6]]
    full = [e.prompt_ids + e.response_ids for e in encoded]
    # A model right on every token of every trajectory...
    next_token = {tuple(ids[: j + 1]): ids[j + 1] for ids in full for j in range(len(ids) - 1)}

    def break_at(i: int, position: int) -> None:  # ...but wrong on the token at `position` of trajectory i
        next_token[tuple(full[i][:position])] = (full[i][position] + 1) % len(tokenizer)

    tool_position = len(encoded[0].prompt_ids) + encoded[0].loss_mask.index(False)
    break_at(0, tool_position)  # a tool token: not the model's to predict, still right
    break_at(1, len(full[1]) - 1)  # the final EOS: wrong
    break_at(2, len(encoded[2].prompt_ids))  # the first sampled token (predicted from the prompt's end): wrong
    break_at(3, len(encoded[3].prompt_ids) - 1)  # the prompt's last token: not sampled, still right
    model = _PrefixModel(next_token, len(tokenizer))
    for batch_size in (1, 4, 64):  # padding inside a batch, a last partial batch
        assert tool_task.argmax_share(model, tokenizer, encoded, batch_size=batch_size) == 4 / 6


def test_manifest_check_names_what_is_wrong(tmp_path: Path) -> None:
    assert "no " in tool_assets.manifest_problem(tmp_path)
    for name in tool_assets.REQUIRED_FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"placeholder {name}\n")
    manifest = {"recipe": tool_assets.recipe(), "files": file_table(tmp_path)}
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    assert tool_assets.manifest_problem(tmp_path) is None
    (tmp_path / "student/model.safetensors").write_text("changed\n")
    assert "differs" in tool_assets.manifest_problem(tmp_path)
    manifest["recipe"] = {**manifest["recipe"], "teacher": asdict(replace(tool_assets.TEACHER, init_seed=9))}
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    assert "recipe" in tool_assets.manifest_problem(tmp_path)


def test_the_rollout_loops_template_deltas_give_the_scripted_encoding(tokenizer, records) -> None:
    """The multi-turn rollout's own ChatTemplate (an independent implementation) appends the same ids."""
    from recipe_gkd.rollout.multi_turn import ChatTemplate, Conversation
    from recipe_gkd.stop_set import stop_set_of

    template = ChatTemplate(tokenizer, stop_set_of(tokenizer, None, chat_template=True, what="the tool tokenizer"))
    for record in records[:3]:
        messages, tools = tool_task.start_messages(record)
        prompt = template.ids(messages, tools, generation_prompt=True)
        env = build_environment(tool_task.ENV_NAME)
        conv = Conversation(0, env, list(messages), tools, prompt, prompt)
        turns = tool_task.scripted_turns(record)
        for i, turn in enumerate(turns):
            if turn["role"] != "assistant":
                continue
            conv.add([*tokenizer(turn["content"], add_special_tokens=False).input_ids, tokenizer.eos_token_id], True)
            observations = [t for t in turns[i + 1 : i + 2] if t["role"] == "tool"]
            if observations:
                delta, conv.rendered = template.tool_turn(conv, turn, observations, stopped=True)
                conv.add(delta, False)
            conv.messages += [turn, *observations]
        expected = tool_task.encode_record(tokenizer, record)
        assert (conv.prompt_ids, conv.response_ids, conv.sampled) == (
            expected.prompt_ids,
            expected.response_ids,
            expected.loss_mask,
        )


REPO_ASSETS = REPO_ROOT / tool_assets.DEFAULT_OUT
# Held-out records the committed models are checked on (the manifest's hashes say the bytes are the build's).
COMMITTED_CHECK_RECORDS = 100


@pytest.mark.slow
def test_committed_assets_match_their_manifest_and_shares() -> None:
    """The assets in the checkout: intact, of the current recipe; on held-out records the teacher solves the
    scripted trajectories and follows a wrong tool (it reads the tool), the student barely solves them."""
    assert tool_assets.manifest_problem(REPO_ASSETS) is None
    records = tool_task.read_jsonl(REPO_ASSETS / "data/eval.jsonl", limit=COMMITTED_CHECK_RECORDS)
    with torch.inference_mode():
        teacher = tool_assets.eval_shares(REPO_ASSETS / "teacher", records)
        student = tool_assets.eval_shares(REPO_ASSETS / "student", records)
    # The build's figures over all 500 records: teacher 98.6% (99.0% with the wrong tool), student 7.8%.
    assert teacher["eval_share"] >= 0.8 and teacher["eval_share_wrong_tool"] >= 0.8
    assert student["eval_share"] <= 0.15
