"""HF rollout engine and worker: sampling, logprobs, weight loading, teacher alignment."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from scorers import HFTopKScorer

from recipe_gkd.config import load_config
from recipe_gkd.offline_models import TinyModelSpec, build_tiny_causal_lm
from recipe_gkd.rollout.hf import HFEngine
from recipe_gkd.rollout.worker import RolloutWorker
from recipe_gkd.targets import build_target


def _cfg(model_dir: Path, data_dir: Path, *extra: str):
    return load_config(
        None,
        [
            f"model.student_path={model_dir}",
            f"data.train_files=[{data_dir / 'train.jsonl'}]",
            f"data.eval_files=[{data_dir / 'train.jsonl'}]",
            "data.train_batch_size=6",
            "data.eval_batch_size=4",
            "actor.micro_batch_size=2",
            "rollout.sampling.max_new_tokens=5",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import json

    d = tmp_path_factory.mktemp("data")
    rows = [
        {"prompt": f"rev:{w}", "response": w[::-1], "answer": w[::-1]}
        for w in ("abc", "hello", "xyz", "mn", "qwert", "ab", "kk")
    ]
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_sampled_logprobs_match_a_fresh_forward(tiny_model_dir: Path, data_dir: Path) -> None:
    engine = HFEngine(_cfg(tiny_model_dir, data_dir))
    prompts = [[1, 4, 72, 73, 5], [1, 4, 80, 5], [1, 4, 72, 73, 74, 75, 76, 5]]
    torch.manual_seed(0)
    gens = engine.generate(prompts, greedy=False)
    for prompt, gen in zip(prompts, gens, strict=True):
        assert 1 <= len(gen.response_ids) <= 5
        eos = engine.tokenizer.eos_token_id
        assert eos not in gen.response_ids[:-1], "response is cut at its first EOS"
        full = np.asarray([prompt + gen.response_ids])
        reference = engine.token_logprobs(full)[0, len(prompt) - 1 :]
        np.testing.assert_allclose(gen.logprobs, reference, atol=1e-4)


def test_greedy_is_deterministic(tiny_model_dir: Path, data_dir: Path) -> None:
    engine = HFEngine(_cfg(tiny_model_dir, data_dir))
    prompts = [[1, 4, 72, 73, 5], [1, 4, 80, 81, 82, 5]]
    a = [g.response_ids for g in engine.generate(prompts, greedy=True)]
    b = [g.response_ids for g in engine.generate(prompts[::-1], greedy=True)][::-1]
    assert a == b


def test_loading_weights_reproduces_another_model(tiny_model_dir: Path, data_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    other_dir = build_tiny_causal_lm(tmp_path / "other", seed=1)
    other = AutoModelForCausalLM.from_pretrained(other_dir, dtype=torch.float32).eval()
    engine = HFEngine(_cfg(tiny_model_dir, data_dir))
    probe = np.asarray([[1, 4, 72, 73, 74, 5, 80, 81, 2]])
    before = engine.token_logprobs(probe)
    named = {k: v.detach().numpy().copy() for k, v in other.state_dict().items()}
    names = sorted(named)
    with pytest.raises(ValueError, match="stale"):
        engine.update_weights((k, named[k]) for k in names[: len(names) // 2])
    assert engine.update_weights((k, named[k]) for k in names) == set(names)
    with torch.no_grad():
        logits = other(input_ids=torch.as_tensor(probe)).logits.float()
    expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, torch.as_tensor(probe)[:, 1:, None])[..., 0].numpy()
    after = engine.token_logprobs(probe)
    assert np.abs(after - expected).max() <= 1e-5 and np.abs(before - expected).max() > 1e-3


# Tiny Qwen3-MoE dims (the default 64-wide Qwen3 attention), 4 experts of width 24, 2 per token, renormalised.
MOE_SPEC = TinyModelSpec(num_experts=4, experts_per_token=2, moe_intermediate_size=24, tie_word_embeddings=False)


def test_a_qwen3_moe_student_takes_per_expert_tensors(data_dir: Path, tmp_path: Path) -> None:
    """transformers holds the experts stacked (gate_up_proj [E, 2I, H], down_proj [E, H, I]); the actor sends them per
    expert under the checkpoint's names. After an update the engine is the other model as transformers loads it from
    disk, its checksums are per expert, and a version missing one expert's tensor is refused naming it."""
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from recipe_gkd.weight_sync import tensor_checksum, weight_mismatches

    student_dir = build_tiny_causal_lm(tmp_path / "student", seed=0, spec=MOE_SPEC, family="qwen3_moe")
    other_dir = build_tiny_causal_lm(tmp_path / "other", seed=1, spec=MOE_SPEC, family="qwen3_moe")
    # save_pretrained's per-expert names: what hub checkpoints ship and the actor exports.
    named = load_file(str(other_dir / "model.safetensors"))
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in named
    engine = HFEngine(_cfg(student_dir, data_dir))
    assert engine.expected == set(named)
    missing = "model.layers.1.mlp.experts.2.down_proj.weight"
    with pytest.raises(ValueError, match=re.escape(f"stale, e.g. {[missing]}")):
        engine.update_weights((k, v) for k, v in named.items() if k != missing)
    assert engine.update_weights(iter(named.items())) == set(named)
    other = AutoModelForCausalLM.from_pretrained(other_dir, dtype=torch.float32).eval()
    ids_BL = torch.as_tensor([[1, 4, 72, 73, 74, 5, 80, 81, 2], [1, 4, 90, 91, 92, 93, 5, 70, 71]])
    with torch.no_grad():
        got_BLV, want_BLV = engine.model(input_ids=ids_BL).logits, other(input_ids=ids_BL).logits
    # The same fp32 values through the same transformers code: equal up to the kernels' reduction order at most.
    assert (got_BLV - want_BLV).abs().max() <= 1e-6
    actor = {name: tensor_checksum(torch.from_numpy(v), torch.float32) for name, v in named.items()}
    assert weight_mismatches(actor, engine.weight_checksums("float32")) == []
    # One expert's tensor left as the student's: the check names that expert's tensor alone.
    stale = "model.layers.0.mlp.experts.1.gate_proj.weight"
    engine.update_weights(iter({**named, stale: load_file(str(student_dir / "model.safetensors"))[stale]}.items()))
    assert weight_mismatches(actor, engine.weight_checksums("float32")) == [f"{stale} differs from the actor's {stale}"]


def test_weight_errors_are_clear(tiny_model_dir: Path, data_dir: Path) -> None:
    engine = HFEngine(_cfg(tiny_model_dir, data_dir))
    with pytest.raises(KeyError, match="does not have"):
        engine.update_weights(iter([("model.nonexistent", np.zeros(3, np.float32))]))
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights(iter([("model.norm.weight", np.ones(7, np.float32))]))


def test_worker_aligns_teacher_rows_with_response_tokens(tiny_model_dir: Path, data_dir: Path) -> None:
    cfg = _cfg(tiny_model_dir, data_dir, "algorithm.lmbda=0.5", "rollout.sampling.max_new_tokens=4")
    scorer = HFTopKScorer(tiny_model_dir, top_k=3)
    worker = RolloutWorker(cfg, rank=0, world=1, target=build_target(cfg))
    worker.setup(scorer=scorer)
    stats, shards = worker.produce(step=0, dp_size=2)
    assert stats.num_sequences == 6 and len(shards) == 2 and [len(s.sequences) for s in shards] == [3, 3]
    sequences = [q for s in shards for q in s.sequences]
    assert {q.on_policy for q in sequences} == {True, False}, "lmbda=0.5 mixes both kinds"
    for q in sequences:
        n = q.num_response_tokens
        assert q.teacher_topk_logprobs.shape == (n, 3) and q.teacher_topk_ids.shape == (n, 3)
        # The server's exact tail and sampled-token logprob travel with the top-k.
        full = torch.log_softmax(
            scorer.model(input_ids=torch.tensor(q.input_ids[None], dtype=torch.long)).logits[0], -1
        )
        rows = full[q.response_start - 1 : len(q.input_ids) - 1].detach()
        expected_tail = torch.logsumexp(rows.scatter(-1, torch.tensor(q.teacher_topk_ids).long(), -torch.inf), -1)
        np.testing.assert_allclose(q.teacher_tail_logmass, expected_tail.numpy(), rtol=1e-5)
        sampled = rows.gather(-1, torch.tensor(q.input_ids[q.response_start :]).long()[:, None])[:, 0]
        np.testing.assert_allclose(q.teacher_sampled_logprob, sampled.numpy(), rtol=1e-5)
        assert q.input_ids[-1] == worker.engine.tokenizer.eos_token_id or n == 4
        if not q.on_policy:
            record_answer = worker.engine.tokenizer.decode(q.input_ids[q.response_start : -1])
            assert q.reward == 1.0 and record_answer == worker.train_stream.dataset[q.sample_id]["response"]
    assert sorted(stats.sample_ids) == sorted(q.sample_id for q in sequences)
    # Rewards are reported apart: the dataset's own (correct) responses never lift the on-policy reward.
    on = [q.reward for q in sequences if q.on_policy]
    assert stats.onpolicy_rewarded == len(on) and stats.onpolicy_reward_sum == sum(on)
    assert stats.offpolicy_rewarded == 6 - len(on) and stats.offpolicy_reward_sum == 6 - len(on)
    mass = sum(float((1 - np.exp(q.teacher_tail_logmass.astype(np.float64))).sum()) for q in sequences)
    assert stats.teacher_topk_mass_sum == pytest.approx(mass, rel=1e-9)


def _with_generation_defaults(model_dir: Path, out: Path) -> Path:
    """A copy of the model whose generation_config.json carries logits processors (as Instruct models ship)."""
    import json
    import shutil

    shutil.copytree(model_dir, out)
    config = json.loads((out / "generation_config.json").read_text())
    config.update({"repetition_penalty": 3.0, "no_repeat_ngram_size": 2, "top_k": 3, "temperature": 0.3})
    (out / "generation_config.json").write_text(json.dumps(config))
    return out


def test_generation_config_json_does_not_change_sampling_or_eval(
    tiny_model_dir: Path, data_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from recipe_gkd.demo.evaluate import greedy_responses

    penalised_dir = _with_generation_defaults(tiny_model_dir, tmp_path / "penalised")
    plain = HFEngine(_cfg(tiny_model_dir, data_dir, "rollout.sampling.max_new_tokens=12"))
    penalised = HFEngine(_cfg(penalised_dir, data_dir, "rollout.sampling.max_new_tokens=12"))
    prompts = [[1, 4, 72, 73, 5], [1, 4, 80, 81, 82, 5], [1, 4, 72, 5]] * 6
    for greedy in (True, False):
        a = plain.generate(prompts, greedy=greedy, seed=7)
        b = penalised.generate(prompts, greedy=greedy, seed=7)
        assert [g.response_ids for g in a] == [g.response_ids for g in b]
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x.logprobs, y.logprobs)
    # The demo's evaluation: same greedy answers.
    texts = ["rev:abc", "rev:hello", "rev:xyz", "rev:qwert"] * 4
    model = AutoModelForCausalLM.from_pretrained(penalised_dir, dtype=torch.float32)
    assert greedy_responses(model, penalised.tokenizer, texts, max_new_tokens=12) == greedy_responses(
        plain.model, plain.tokenizer, texts, max_new_tokens=12
    )
    assert model.generation_config.repetition_penalty == 3.0, "the model's own config is left as it was"
    # The check can fail: a bare generate() applies the penalty and answers differently.
    ids = torch.tensor([prompts[0]] * 4)
    bare = model.generate(input_ids=ids, do_sample=False, max_new_tokens=12, pad_token_id=0)
    ours = plain.generate([prompts[0]], greedy=True)[0].response_ids
    assert bare[0, ids.shape[1] :].tolist()[: len(ours)] != ours


def test_worker_union_plan_names_the_students_top_ids(tiny_model_dir: Path, data_dir: Path) -> None:
    """algorithm.support=union: the engine's top-k_s ids (of a fresh forward) go out with the score request;
    each Sequence holds the teacher's top-k and those ids (repeats excluded) and the teacher's exact rest."""
    from recipe_gkd.batch import EXCLUDED_ID
    from recipe_gkd.runtime.local_pools import InProcessTeacher

    union = ["algorithm.support=union", "rollout.student_top_k=4", f"teacher.model_path={tiny_model_dir}"]
    cfg = _cfg(tiny_model_dir, data_dir, *union, "teacher.top_k=3")
    worker = RolloutWorker(cfg, rank=0, world=1, target=build_target(cfg))
    worker.setup(scorer=InProcessTeacher(cfg))
    _, shards = worker.produce(step=0, dp_size=1)
    assert worker.engine is not None
    for q in shards[0].sequences:
        n = q.num_response_tokens
        assert q.teacher_topk_ids.shape == (n, 3 + 4)
        with torch.no_grad():
            logits = worker.engine.model(input_ids=torch.tensor(q.input_ids[None], dtype=torch.long)).logits[0]
        rows = torch.log_softmax(logits[q.response_start - 1 : -1].double(), -1)  # the teacher is the same model
        student_top = rows.topk(4, dim=-1).indices.numpy()
        named = q.teacher_topk_ids[:, 3:]
        kept = named != EXCLUDED_ID
        np.testing.assert_array_equal(named[kept], student_top[kept])
        # A student id is excluded exactly where the teacher's top-3 holds it.
        in_teacher = (student_top[:, :, None] == q.teacher_topk_ids[:, None, :3]).any(-1)
        np.testing.assert_array_equal(~kept, in_teacher)
        np.testing.assert_allclose(
            q.teacher_topk_logprobs[:, 3:][kept], rows.gather(-1, torch.tensor(student_top)).numpy()[kept], atol=1e-5
        )
        rest = rows.scatter(-1, torch.tensor(student_top), -torch.inf)
        rest = rest.scatter(-1, torch.tensor(q.teacher_topk_ids[:, :3]).long(), -torch.inf)
        np.testing.assert_allclose(q.teacher_tail_logmass, torch.logsumexp(rest, -1).numpy(), atol=1e-5)
