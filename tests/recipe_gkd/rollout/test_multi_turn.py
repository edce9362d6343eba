"""Multi-turn rollouts, token in, token out (recipe_gkd/rollout/multi_turn.py) on a byte-level BPE tokenizer with a
Qwen-style ChatML tool template (system prompt, eos == pad): a scripted policy for exact ids, a real tiny model on
the HF engine for sampled ones (the vLLM engine: tests/recipe_gkd/rollout/test_multi_turn_vllm.py)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from repo_paths import REPO_ROOT
from tool_chat import (
    AWKWARD_RESULT,
    EchoEnv,
    Recording,
    ScriptedPolicy,
    check_sampled_conversations,
    rollout,
    scripted_logprobs,
    segments,
    tool_call,
    with_tool_template,
)

from recipe_gkd.envs import build_environment
from recipe_gkd.envs.deadline import TOOL_GUARD_SLACK_S
from recipe_gkd.envs.protocol import Tool, ToolResult
from recipe_gkd.envs.tasks import ToolTaskEnv
from recipe_gkd.rollout.multi_turn import (
    Conversation,
    Limits,
    MultiTurnRollout,
    TemplateMismatch,
    conversation_counts,
    episode_seed,
)
from recipe_gkd.targets import build_target

RECORD = {"prompt": "A shop sells 17 boxes of 23 pens and 4 loose pens. How many pens?", "answer": "395"}
SOLVE = [
    "I will multiply first.\n" + tool_call("calculator", expression="17 * 23"),
    tool_call("calculator", expression="391 + 4"),
    "The shop has 395",
]


@pytest.fixture(scope="module")
def tokenizer(chatml_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("tool_tokenizer")
    shutil.copytree(chatml_tokenizer_dir, out, dirs_exist_ok=True)
    return with_tool_template(out)


def calculator(max_turns: int = 6, tool_timeout_s: float = 5.0) -> Any:
    return lambda: build_environment("calculator", max_turns=max_turns, tool_timeout_s=tool_timeout_s)


def render(tokenizer: Any, conv: Conversation, **kwargs: Any) -> list[int]:
    """The whole conversation rendered by the template at once (the independent reference)."""
    return list(tokenizer.apply_chat_template(conv.messages, tools=conv.tools or None, return_dict=False, **kwargs))


def assert_whole_rendering(tokenizer: Any, conv: Conversation) -> None:
    """prompt + response ids == the final conversation rendered whole, up to the template's newline after the
    last EOS (the response ends at the sampled EOS)."""
    whole = render(tokenizer, conv)
    ids = conv.prompt_ids + conv.response_ids
    assert conv.response_ids[-1] == tokenizer.eos_token_id
    assert whole[: len(ids)] == ids
    assert tokenizer.decode(whole[len(ids) :]) == "\n"


def test_scripted_conversation_equals_the_whole_rendering(tokenizer: Any) -> None:
    policy = ScriptedPolicy(tokenizer, {RECORD["prompt"]: SOLVE, "echo me": ["first", "second", "done: 7"]})
    loop = rollout(policy, calculator())
    calc = loop.start(3, RECORD, seed=11)
    loop.new_env = lambda: EchoEnv(results=(AWKWARD_RESULT, "error: no such thing"), answer_on=3)
    echo = loop.start(4, {"prompt": "echo me"}, seed=12)
    loop.run([calc, echo], greedy=False, seed=5)

    for conv, script in ((calc, SOLVE), (echo, ["first", "second", "done: 7"])):
        assert conv.prompt_ids == list(
            tokenizer.apply_chat_template(
                conv.messages[:2], tools=conv.tools, add_generation_prompt=True, return_dict=False
            )
        )
        assert_whole_rendering(tokenizer, conv)
        runs = segments(conv)
        assert [sampled for sampled, _, _ in runs] == [True, False, True, False, True]
        for turn, (_, ids, lps) in enumerate(runs[::2]):  # the student's turns: its ids and logprobs, as sampled
            assert ids == [*tokenizer.encode(script[turn], add_special_tokens=False), tokenizer.eos_token_id]
            np.testing.assert_array_equal(np.float32(lps), scripted_logprobs(len(ids), turn))
        assert all(lp == 0.0 for _, _, lps in runs[1::2] for lp in lps)
        assert (conv.reward, conv.ending, conv.turns) == (1.0, "answer", 3)
    # The calculator's results, and the awkward result with its split characters and special tokens' text, as the
    # template renders them between the turns.
    assert "<tool_response>\n391\n</tool_response>" in tokenizer.decode(segments(calc)[1][1])
    assert AWKWARD_RESULT in tokenizer.decode(segments(echo)[1][1])
    assert (calc.tool_calls, calc.tool_failures, echo.tool_calls, echo.tool_failures) == (2, 0, 4, 2)
    # One batched generate per turn, for every live conversation.
    assert [len(call["prompts"]) for call in policy.calls] == [2, 2, 2]
    counts = conversation_counts([calc, echo])
    assert counts["turns"] == 6 and counts["tool_calls"] == 6 and counts["ended_answer"] == 2
    assert counts["tool_tokens"] == sum(len(ids) for conv in (calc, echo) for _, ids, _ in segments(conv)[1::2])


def test_a_malformed_call_is_answered_and_the_conversation_goes_on(tokenizer: Any) -> None:
    broken = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"\n</tool_call>'
    policy = ScriptedPolicy(tokenizer, {RECORD["prompt"]: [broken, *SOLVE]})
    loop = rollout(policy, calculator())
    (conv,) = loop.run([loop.start(0, RECORD, seed=0)], greedy=True, seed=None)
    assert conv.messages[3]["content"].startswith("error: the tool call is not valid JSON")
    assert (conv.turns, conv.tool_calls, conv.tool_failures, conv.reward) == (4, 3, 1, 1.0)
    assert_whole_rendering(tokenizer, conv)


def test_max_turns_ends_the_conversation_without_running_its_calls(tokenizer: Any) -> None:
    policy = ScriptedPolicy(tokenizer, {RECORD["prompt"]: SOLVE})
    loop = rollout(policy, calculator(max_turns=2), max_turns=2)
    (conv,) = loop.run([loop.start(0, RECORD, seed=0)], greedy=True, seed=None)
    assert (conv.turns, conv.ending, conv.reward, conv.tool_calls) == (2, "max_turns", 0.0, 2)
    assert len(conv.messages) == 5  # system, user, assistant, tool, assistant: the last call was not run


def test_max_total_tokens_bounds_every_turn_and_the_conversation(tokenizer: Any) -> None:
    policy = ScriptedPolicy(tokenizer, {RECORD["prompt"]: SOLVE})
    loop = rollout(policy, calculator())
    prompt_len = len(loop.start(0, RECORD, seed=0).prompt_ids)
    first_turn = len(tokenizer.encode(SOLVE[0], add_special_tokens=False)) + 1
    # Room for the first turn, its tool result and 5 tokens of the second turn.
    full = rollout(policy, calculator()).run([loop.start(0, RECORD, seed=0)], greedy=True, seed=None)[0]
    between = len(segments(full)[1][1])
    limit = prompt_len + first_turn + between + 5
    loop = rollout(policy, calculator(), max_total=limit)
    policy.calls.clear()
    (conv,) = loop.run([loop.start(0, RECORD, seed=0)], greedy=True, seed=None)
    assert [call["max_new_tokens"] for call in policy.calls] == [[min(200, limit - prompt_len)], [5]]
    assert conv.length == limit and conv.ending == "max_total_tokens" and conv.reward == 0.0
    # No room for a tool result and one more token: the conversation ends on the turn, without the result.
    loop = rollout(policy, calculator(), max_total=prompt_len + first_turn + between)
    (conv,) = loop.run([loop.start(0, RECORD, seed=0)], greedy=True, seed=None)
    assert conv.length == prompt_len + first_turn and conv.ending == "max_total_tokens" and conv.turns == 1


def test_a_template_that_rewrites_earlier_turns_is_refused_by_name(tokenizer: Any) -> None:
    # Qwen3-like: earlier assistant turns lose their text once more follows; not append-only.
    rewriting = tokenizer.chat_template.replace(
        "message.role + '\\n' + message.content + '<|im_end|>'",
        "message.role + '\\n' + (message.content if loop.last or message.role != 'assistant' else '') + '<|im_end|>'",
    )
    assert rewriting != tokenizer.chat_template
    saved = tokenizer.chat_template
    tokenizer.chat_template = rewriting
    try:
        loop = rollout(ScriptedPolicy(tokenizer, {RECORD["prompt"]: SOLVE}), calculator())
        with pytest.raises(
            TemplateMismatch, match=r"the chat template of '.*tool_tokenizer.*' renders the conversation"
        ):
            loop.run([loop.start(0, RECORD, seed=0)], greedy=True, seed=None)
        # A template that closes assistant turns with no special token at all (a blank line): the stop set has no
        # turn end, and the EOS never follows an assistant's content.
        tokenizer.chat_template = saved.replace(
            "message.content + '<|im_end|>'",
            "message.content + ('\\n\\n' if message.role == 'assistant' else '<|im_end|>')",
        )
        loop = rollout(ScriptedPolicy(tokenizer, {RECORD["prompt"]: SOLVE}), calculator())
        with pytest.raises(TemplateMismatch, match=r"does not close an assistant turn with '<\|im_end\|>'"):
            loop.run([loop.start(0, RECORD, seed=0)], greedy=True, seed=None)
    finally:
        tokenizer.chat_template = saved


class SleepyTool:
    """A tool that cannot bound itself (a hung library call)."""

    name: ClassVar[str] = "calculator"
    description: ClassVar[str] = "Hangs."
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {"expression": {"type": "string"}}}

    def __call__(self, arguments: Any) -> ToolResult:
        time.sleep(60)
        return ToolResult("never")


class SleepyEnv(ToolTaskEnv):
    name: ClassVar[str] = "sleepy"

    def build_tools(self, *, tool_timeout_s: float, tool_isolation: str) -> list[Tool]:
        return [SleepyTool()]


def test_a_slow_tool_is_cut_at_tool_timeout_s(tokenizer: Any) -> None:
    policy = ScriptedPolicy(tokenizer, {RECORD["prompt"]: SOLVE})
    loop = rollout(policy, lambda: SleepyEnv(max_turns=6, tool_timeout_s=0.2))
    convs = [loop.start(i, RECORD, seed=i) for i in range(3)]
    start = time.perf_counter()
    loop.run(convs, greedy=True, seed=None)
    elapsed = time.perf_counter() - start
    # Two turns with a call each, the three conversations' calls side by side: two timeouts, not six, not 60 s.
    assert elapsed < 2 * (0.2 + TOOL_GUARD_SLACK_S) + 1.5
    for conv in convs:
        assert conv.messages[3]["content"] == "error: the calculator tool timed out after 0.2 s"
        assert (conv.tool_failures, conv.ending) == (2, "answer")


def test_the_sandbox_is_bounded_by_the_same_timeout() -> None:
    env = build_environment("python", max_turns=3, tool_timeout_s=0.5, tool_isolation="socket_guard")
    env.reset({"prompt": "loop", "answer": "1"})
    start = time.perf_counter()
    step = env.step({"role": "assistant", "content": tool_call("python", code="while True:\n    pass")})
    assert time.perf_counter() - start < 0.5 + TOOL_GUARD_SLACK_S
    # The sandbox's own answer (it killed the program), not the guard's.
    assert "timed out after 0.5 s" in step.observations[0]["content"] and "tool timed out" not in str(step)
    assert step.tool_failures == 1


def test_episode_seeds_are_a_function_of_seed_sample_and_epoch(tokenizer: Any) -> None:
    assert episode_seed(1, 7, 0) == episode_seed(1, 7, 0)
    assert len({episode_seed(1, 7, 0), episode_seed(1, 8, 0), episode_seed(1, 7, 1), episode_seed(2, 7, 0)}) == 4
    envs: list[EchoEnv] = []
    loop = rollout(ScriptedPolicy(tokenizer, {"x": ["a"]}), lambda: envs.append(EchoEnv()) or envs[-1])
    loop.start(7, {"prompt": "x"}, seed=episode_seed(1, 7, 0))
    assert envs[0].seeds == [episode_seed(1, 7, 0)]


# ----------------------------------------------------------------------------- a real tiny model (HF engine)


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Llama with the ChatML BPE tokenizer and the tool template."""
    from recipe_gkd.offline_models import TinyModelSpec, build_tiny_causal_lm

    # Positions for a conversation: the tools' system prompt alone is ~400 tokens of this small vocabulary.
    spec = TinyModelSpec(max_position_embeddings=1024)
    out = build_tiny_causal_lm(
        tmp_path_factory.mktemp("tool_model") / "m", seed=3, spec=spec, tokenizer_kind="chatml_bpe"
    )
    with_tool_template(out)
    return out


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import json

    d = tmp_path_factory.mktemp("tool_data")
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in ((3, 4), (12, 30), (7, 7), (1, 99))]
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def tool_cfg(model_dir: Path, data_dir: Path, *extra: str) -> Any:
    from recipe_gkd.config import load_config

    return load_config(
        None,
        [
            f"model.student_path={model_dir}",
            "rollout.backend=hf",
            f"data.train_files=[{data_dir / 'train.jsonl'}]",
            f"data.eval_files=[{data_dir / 'train.jsonl'}]",
            "data.train_batch_size=2",
            "data.eval_batch_size=2",
            "actor.micro_batch_size=1",
            "data.max_prompt_length=448",
            "rollout.env=calculator",
            "rollout.max_total_tokens=1024",
            "rollout.sampling.max_new_tokens=12",
            *extra,
        ],
    )


def test_hf_engine_conversations_equal_the_template(tool_model_dir: Path, data_dir: Path) -> None:
    from recipe_gkd.rollout.hf import HFEngine

    engine = Recording(HFEngine(tool_cfg(tool_model_dir, data_dir)))
    loop = rollout(engine, lambda: EchoEnv(results=(AWKWARD_RESULT, "42"), answer_on=3), max_new=12)
    convs = [loop.start(i, {"prompt": f"question {i} é"}, seed=i) for i in range(3)]
    loop.run(convs, greedy=False, seed=17)
    assert [c.turns for c in convs] == [3, 3, 3] and [len(r) for r in engine.returned] == [3, 3, 3]
    check_sampled_conversations(engine.tokenizer, engine, convs)


def test_hf_engine_limits_each_prompt(tool_model_dir: Path, data_dir: Path) -> None:
    """Per-prompt max_new_tokens: the same tokens as one limit for all, each cut at its own."""
    from recipe_gkd.rollout.hf import HFEngine

    engine = HFEngine(tool_cfg(tool_model_dir, data_dir, "rollout.sampling.max_new_tokens=9"))
    prompts = [engine.tokenizer.encode("hello world"), engine.tokenizer.encode("the water")]
    # A never-stopping policy: EOS pushed out of reach, so each response runs to its limit.
    with torch_no_eos(engine):
        same = engine.generate(prompts, greedy=False, seed=3)
        each = engine.generate(prompts, greedy=False, seed=3, max_new_tokens=[3, 9])
    assert [len(g.response_ids) for g in each] == [3, 9]
    assert each[0].response_ids == same[0].response_ids[:3] and each[1].response_ids == same[1].response_ids
    with pytest.raises(ValueError, match="one limit >= 1 per prompt"):
        engine.generate(prompts, greedy=True, max_new_tokens=[3])


class torch_no_eos:
    """The engine's model never predicts EOS (its output row for EOS at -1e9) while in the block."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def __enter__(self) -> None:
        head = self.engine.model.get_output_embeddings()
        eos = self.engine.tokenizer.eos_token_id

        def hook(module: Any, args: Any, output: Any) -> Any:
            output[..., eos] = -1e9
            return output

        self.handle = head.register_forward_hook(hook)

    def __exit__(self, *exc: Any) -> None:
        self.handle.remove()


# ----------------------------------------------------------------------------- the rollout worker


def echo_worker(cfg: Any, envs: list[EchoEnv]) -> Any:
    """A rollout worker with an in-process teacher, its conversations held with EchoEnv (a random model never calls
    the calculator by itself); `envs` collects every environment built."""
    from scorers import HFTopKScorer

    from recipe_gkd.rollout.producers import Conversations
    from recipe_gkd.rollout.worker import RolloutWorker

    worker = RolloutWorker(cfg, rank=0, world=1, target=build_target(cfg))
    worker.setup(scorer=HFTopKScorer(Path(cfg.model.student_path), top_k=3))
    assert isinstance(worker.producer, Conversations)

    def new_env() -> EchoEnv:
        envs.append(EchoEnv(results=("7", "error: nope"), answer_on=2))
        return envs[-1]

    worker.producer.loop.new_env = new_env
    return worker


def test_worker_sequences_carry_the_mask_and_a_resume_repeats_them(tool_model_dir: Path, data_dir: Path) -> None:
    cfg = tool_cfg(tool_model_dir, data_dir)
    envs: list[EchoEnv] = []
    worker = echo_worker(cfg, envs)
    stats0, _ = worker.produce(step=0, dp_size=1)
    stats1, shards1 = worker.produce(step=1, dp_size=1)
    position = worker.data_position(0)
    sequences = shards1[0].sequences
    for seq in sequences:
        n = seq.num_response_tokens
        assert seq.sampled_mask is not None and seq.sampled_mask.shape == (n,) and seq.sampled_mask.dtype == bool
        assert seq.sampled_mask[0] and seq.sampled_mask[-1] and not seq.sampled_mask.all()
        assert (seq.rollout_logprobs[~seq.sampled_mask] == 0.0).all()
        assert (seq.rollout_logprobs[seq.sampled_mask] < 0.0).all()
        # The teacher scored every response token of the whole conversation, tool tokens included.
        assert seq.teacher_sampled_logprob.shape == (n,) and seq.reward == 1.0 and seq.on_policy
    assert stats1.episodes["conversations"] == 2 and stats1.episodes["turns"] == 4
    assert stats1.episodes["tool_calls"] == 4 and stats1.episodes["tool_failures"] == 2
    assert stats1.episodes["tool_tokens"] == sum(int((~s.sampled_mask).sum()) for s in sequences)
    from recipe_gkd.observe.metrics import episode_columns

    all_tokens = sum(s.num_response_tokens for s in sequences)
    assert episode_columns([stats1], "")["tool_token_frac"] == pytest.approx(
        stats1.episodes["tool_tokens"] / all_tokens
    )
    assert stats1.onpolicy_reward_sum == 2.0 and stats1.onpolicy_rewarded == 2

    # A resumed worker (a new process after kill -9: the checkpoint's data position) holds the same conversations.
    resumed_envs: list[EchoEnv] = []
    resumed = echo_worker(cfg, resumed_envs)
    resumed.set_position(position)
    _, again = resumed.produce(step=1, dp_size=1)
    for seq, rep in zip(sequences, again[0].sequences, strict=True):
        assert seq.sample_id == rep.sample_id
        np.testing.assert_array_equal(seq.input_ids, rep.input_ids)
        np.testing.assert_array_equal(seq.sampled_mask, rep.sampled_mask)
        np.testing.assert_array_equal(seq.rollout_logprobs, rep.rollout_logprobs)
    assert [e.seeds for e in resumed_envs] == [e.seeds for e in envs[2:]]
    assert [e.seeds for e in envs[2:]] == [[episode_seed(cfg.data.seed, s.sample_id, 0)] for s in sequences]
    assert stats0.episodes["conversations"] == 2

    # Evaluation: the same loop, greedy; its counters come back with the evaluation's stats.
    eval_stats, eval_shards = worker.produce_eval(dp_size=1)
    assert eval_stats.episodes["turns"] == 4 and eval_stats.onpolicy_rewarded == 2
    assert all(s.sampled_mask is not None for s in eval_shards[0].sequences)


def test_conversation_accuracy_counts_the_environments_rewards(tokenizer: Any) -> None:
    from recipe_gkd.rollout.multi_turn import conversation_accuracy

    wrong = {"prompt": "How many legs have 3 cats?", "answer": "12"}
    policy = ScriptedPolicy(tokenizer, {RECORD["prompt"]: SOLVE, wrong["prompt"]: ["Eleven: 11"]})
    records = [RECORD, wrong, {"prompt": "no answer here"}]
    accuracy = conversation_accuracy(rollout(policy, calculator()), records, "answer", data_seed=1)
    assert (accuracy.correct, accuracy.answered, accuracy.records) == (1.0, 2, 3)
    assert all(call["greedy"] and call["seed"] is None for call in policy.calls)


def test_teacher_accuracy_holds_the_conversations_on_the_teachers_model(
    tool_model_dir: Path, data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report's teacher accuracy with rollout.env: the teacher's model in the same greedy conversations with the
    environment (here a scripted teacher that solves one of the two held-out questions with the calculator)."""
    teacher_dir = tmp_path / "teacher"
    shutil.copytree(tool_model_dir, teacher_dir)
    # The calculator's tool schema makes a long system prompt in this small vocabulary.
    cfg = tool_cfg(tool_model_dir, data_dir, f"teacher.model_path={teacher_dir}", "data.max_prompt_length=700")
    worker = echo_worker(cfg, [])
    built: list[str] = []

    def scripted_teacher(engine_cfg: Any) -> ScriptedPolicy:
        built.append(engine_cfg.model.student_path)
        solve = [tool_call("calculator", expression="3 + 4"), "It is 7"]
        return ScriptedPolicy(worker.engine.tokenizer, {"What is 3 + 4?": solve, "What is 12 + 30?": ["41"]})

    monkeypatch.setattr("recipe_gkd.rollout.hf.HFEngine", scripted_teacher)
    teacher = worker.teacher_accuracy()
    assert built == [str(teacher_dir)]
    assert (teacher.correct, teacher.answered, teacher.records) == (1.0, 2, 2)


def test_episode_columns() -> None:
    from recipe_gkd.batch import RolloutStats
    from recipe_gkd.observe.metrics import episode_columns

    def stats(tokens: int, **episodes: float) -> RolloutStats:
        return RolloutStats(0, 0, 2, tokens, [0, 1], {}, episodes=episodes)

    zeros = {"ended_max_turns": 0.0, "ended_max_total_tokens": 1.0, "ended_answer": 1.0}
    a = stats(100, conversations=2, turns=5, tool_calls=3, tool_failures=1, tool_tokens=40, tool_s=0.5, **zeros)
    b = stats(60, conversations=2, turns=3, tool_calls=1, tool_failures=0, tool_tokens=20, tool_s=1.5, **zeros)
    cols = episode_columns([a, b], "eval_")
    assert cols["eval_turns"] == 2.0 and cols["eval_tool_calls"] == 4 and cols["eval_tool_failures"] == 1
    # RolloutStats.num_response_tokens counts the sampled tokens: 160 of them, and 60 tool tokens.
    assert cols["eval_tool_token_frac"] == pytest.approx(60 / 220) and cols["eval_tool_s"] == 1.5
    assert cols["eval_ended_max_total_tokens"] == 2
    assert episode_columns([stats(10)], "") == {}


# ----------------------------------------------------------------------------- what rollout.env refuses

PRESETS = REPO_ROOT / "configs" / "presets"


@pytest.mark.parametrize(
    ("config", "overrides", "key", "says"),
    [
        ("cpu_demo", ["rollout.env=calc"], "rollout.env", "known environments: calculator, python"),
        ("cpu_demo", ["algorithm.cross_tokenizer=span"], "algorithm.cross_tokenizer", "student's tokens only"),
        ("cpu_two_teachers", [], "teachers", "take one teacher"),
        ("cpu_demo", ["data.teacher_prompt_key=hint"], "data.teacher_prompt_key", "a prompt of its own"),
        ("cpu_demo", ["data.teacher_prompt_template='{prompt} hint'"], "data.teacher_prompt_template", "of its own"),
        ("cpu_demo", ["algorithm.lmbda=0.5"], "algorithm.lmbda", "set it to 1.0"),
        ("cpu_demo", ["algorithm.support=union", "rollout.student_top_k=4"], "algorithm.support", "tool tokens"),
        ("cpu_demo", ["data.apply_chat_template=false"], "data.apply_chat_template", "chat template"),
        ("cpu_demo", ["data.max_prompt_length=512", "rollout.max_total_tokens=512"], "rollout.max_total_tokens", ""),
    ],
)
def test_refusals_name_the_key_and_exit_2(
    config: str, overrides: list[str], key: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from recipe_gkd.config import ConfigError, load_config
    from recipe_gkd.main import main

    args = [*overrides, "rollout.env=calculator"] if "rollout.env=calc" not in overrides else overrides
    with pytest.raises(ConfigError) as info:
        load_config(PRESETS / f"{config}.yaml", args)
    assert info.value.key == key and says in str(info.value)
    assert main(["--config", str(PRESETS / f"{config}.yaml"), "--dry-run", *args]) == 2
    assert key in capsys.readouterr().err


def test_a_multi_turn_config_bounds_every_length_by_max_total_tokens() -> None:
    from recipe_gkd.config import ConfigError, load_config
    from recipe_gkd.config.derived import longest_sequence
    from recipe_gkd.config.rules import teacher_longest_sequence

    cfg = load_config(PRESETS / "cpu_demo.yaml", ["rollout.env=calculator", "rollout.max_total_tokens=900"])
    assert longest_sequence(cfg) == (900, "rollout.max_total_tokens")
    assert teacher_longest_sequence(cfg) == (900, "rollout.max_total_tokens")
    with pytest.raises(ConfigError) as info:
        load_config(
            PRESETS / "cpu_demo.yaml",
            ["rollout.env=calculator", "rollout.max_total_tokens=900", "actor.max_tokens_per_micro_batch=800"],
        )
    assert info.value.key == "actor.max_tokens_per_micro_batch" and "rollout.max_total_tokens = 900" in str(info.value)


def test_the_environment_is_built_from_the_rollout_keys(tokenizer: Any) -> None:
    from recipe_gkd.config import load_config

    cfg = load_config(
        PRESETS / "cpu_demo.yaml",
        [
            "rollout.env=python",
            "rollout.max_turns=3",
            "rollout.tool_timeout_s=2.5",
            "rollout.tool_isolation=socket_guard",
            "rollout.tool_call_format=llama3_json",
            "data.prompt_key=question",
            "data.answer_key=solution",
        ],
    )
    loop = MultiTurnRollout.from_config(cfg, ScriptedPolicy(tokenizer, {}))
    env = loop.new_env()
    assert env.name == "python" and env.max_turns == 3 and env.tool_timeout_s == 2.5
    assert env._tools["python"].sandbox.limits.timeout_s == 2.5  # one rule: the sandbox's own wall time
    assert env._tools["python"].sandbox.isolation.name == "socket_guard"
    assert type(env._format).__name__ == "Llama3JsonCalls"
    assert env.reset({"question": "q", "solution": "1"})[1]["content"] == "q"
    assert loop.limits == Limits(3, cfg.rollout.max_total_tokens, cfg.rollout.sampling.max_new_tokens)
