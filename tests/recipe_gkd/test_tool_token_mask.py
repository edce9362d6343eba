"""Multi-turn rollouts: the response tokens the student did not sample (a tool's output, the chat template's turn
markers) are attended, never trained, never counted (ScoredSequence.sampled_mask).

The sequences are real ChatML conversations in the byte-level BPE (system prompt, eos == pad == <|im_end|>, split
UTF-8 characters, special-token strings inside the tool's text); the teacher rows are a real distribution's, so the
float64 references below are computed from the full logits independently of recipe_gkd/losses.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from target_kinds import kinds

from recipe_gkd.actor.collate import collate
from recipe_gkd.actor.objective import ActorObjective
from recipe_gkd.batch import ScoredSequence, trained_tokens
from recipe_gkd.config import load_config
from recipe_gkd.parallel_layout import ParallelLayout
from recipe_gkd.rollout.worker import summarize
from recipe_gkd.targets import build_target
from recipe_gkd.targets.hidden import Hidden, HiddenStates
from recipe_gkd.targets.spans import Spans

TOP_K = 6
HIDDEN = 16
# Figures of RolloutStats that must not see the rows the student did not sample.
STATS_FIGURES = (
    "num_response_tokens",
    "teacher_topk_mass_sum",
    "onpolicy_tokens",
    "rollout_logprob_sum",
    "teacher_sampled_logprob_sum",
)
# float32 against float64 over V = 512: a log-softmax row is exact to a few float32 ulps of its largest term
# (~10 nats here: ~1e-6 absolute), summed over < 100 rows whose terms are ~0.1-3 nats: 1e-5 relative bounds it.
RTOL = 1e-5


def tokenizer(chatml_tokenizer_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(chatml_tokenizer_dir))


def conversation(tok, question: str, call: str, tool_output: str, answer: str) -> tuple[list[int], int, np.ndarray]:
    """ids of [system, user] + assistant tool call + the tool's turn + the final answer, the response start, and the
    sampled mask: the two assistant turns (each closed by the <|im_end|> the student samples) True, the template's
    delta between them (newline, the tool turn, the next assistant header) False."""
    messages = [
        {"role": "system", "content": "Use the calculator. Réponds en français 🙂"},
        {"role": "user", "content": question},
    ]
    prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    turn1 = [*tok.encode(call, add_special_tokens=False), end]
    delta = tok.encode(
        f"\n<|im_start|>tool\n{tool_output}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    turn2 = [*tok.encode(answer, add_special_tokens=False), end]
    mask = np.array([True] * len(turn1) + [False] * len(delta) + [True] * len(turn2))
    return prompt + turn1 + delta + turn2, len(prompt), mask


def scored(
    ids: list[int], start: int, mask: np.ndarray | None, vocab: int, seed: int, sample_id: int
) -> ScoredSequence:
    """The sequence with a random teacher's exact top-k (a real distribution per row) and sampling logprobs; the rows
    the student did not sample carry what a rollout puts there: rollout logprob 0.0 (the placeholder)."""
    rng = np.random.default_rng(seed)
    n = len(ids) - start
    logits_NV = rng.standard_normal((n, vocab)) * 3
    logprobs_NV = logits_NV - np.logaddexp.reduce(logits_NV, axis=1, keepdims=True)
    ids_NK = np.argsort(-logprobs_NV, axis=1)[:, :TOP_K]
    top_NK = np.take_along_axis(logprobs_NV, ids_NK, 1)
    tail_N = np.log1p(-np.exp(np.logaddexp.reduce(top_NK, axis=1)))
    rollout_N = (-rng.exponential(1.5, n)).astype(np.float32)
    if mask is not None:
        rollout_N[~mask] = 0.0
    hidden = HiddenStates.from_float32(_bf16(rng.standard_normal((n, HIDDEN)).astype(np.float32)), "bfloat16")
    return ScoredSequence(
        sample_id=sample_id,
        input_ids=np.asarray(ids, dtype=np.int32),
        response_start=start,
        on_policy=True,
        teacher_topk_logprobs=top_NK.astype(np.float32),
        teacher_topk_ids=ids_NK.astype(np.int32),
        teacher_tail_logmass=tail_N.astype(np.float32),
        teacher_sampled_logprob=np.take_along_axis(logprobs_NV, np.asarray(ids[start:])[:, None], 1)[:, 0].astype(
            np.float32
        ),
        rollout_logprobs=rollout_N,
        reward=1.0,
        payload=hidden,
        sampled_mask=mask,
    )


def _bf16(values: np.ndarray) -> np.ndarray:
    return torch.from_numpy(values).to(torch.bfloat16).float().numpy()


def other_values_off_the_samples(seq: ScoredSequence, seed: int) -> ScoredSequence:
    """`seq` with different teacher rows, rollout and teacher logprobs and hidden states where the student did not
    sample: any of them reaching a loss or a metric changes it."""
    rng = np.random.default_rng(seed)
    off = ~seq.sampled_rows()
    out = dataclasses.replace(
        seq,
        teacher_topk_logprobs=seq.teacher_topk_logprobs.copy(),
        teacher_topk_ids=seq.teacher_topk_ids.copy(),
        teacher_tail_logmass=seq.teacher_tail_logmass.copy(),
        teacher_sampled_logprob=seq.teacher_sampled_logprob.copy(),
        rollout_logprobs=None if seq.rollout_logprobs is None else seq.rollout_logprobs.copy(),
    )
    k = off.sum()
    out.teacher_topk_logprobs[off] = np.sort(-rng.exponential(3.0, (k, TOP_K)), axis=1)[:, ::-1] - 2.0
    out.teacher_topk_ids[off] = rng.permutation(seq.teacher_topk_ids.max() + 1)[:TOP_K]
    out.teacher_tail_logmass[off] = -rng.exponential(0.5, k)
    out.teacher_sampled_logprob[off] = -rng.exponential(2.0, k)
    assert out.rollout_logprobs is not None
    out.rollout_logprobs[off] = -rng.exponential(2.0, k)
    bits = seq.payload.bits.copy()  # type: ignore[union-attr]
    bits[off] = HiddenStates.from_float32(_bf16(rng.standard_normal((k, HIDDEN)).astype(np.float32)), "bfloat16").bits
    out.payload = HiddenStates(bits, "bfloat16")
    return out


def only_sampled(seq: ScoredSequence, sample_id: int) -> ScoredSequence:
    """The single-turn sequence made of `seq`'s prompt and the tokens the student sampled, with their rows."""
    keep = seq.sampled_rows()
    return ScoredSequence(
        sample_id=sample_id,
        input_ids=np.concatenate([seq.input_ids[: seq.response_start], seq.input_ids[seq.response_start :][keep]]),
        response_start=seq.response_start,
        on_policy=True,
        teacher_topk_logprobs=seq.teacher_topk_logprobs[keep],
        teacher_topk_ids=seq.teacher_topk_ids[keep],
        teacher_tail_logmass=seq.teacher_tail_logmass[keep],
        teacher_sampled_logprob=seq.teacher_sampled_logprob[keep],
        rollout_logprobs=None if seq.rollout_logprobs is None else seq.rollout_logprobs[keep],
        reward=seq.reward,
        payload=HiddenStates(seq.payload.bits[keep], "bfloat16"),  # type: ignore[union-attr]
    )


@pytest.fixture(scope="module")
def batch(chatml_tokenizer_dir: Path) -> tuple[list[ScoredSequence], int]:
    """Two multi-turn conversations and one single-turn (no mask), and the vocabulary size."""
    tok = tokenizer(chatml_tokenizer_dir)
    vocab = len(tok)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 + 7"}}</tool_call>'
    one = conversation(tok, "Combien font 12 + 7 ? Réponse: ", call, "19 — exact <|im_start|>", "12 + 7 = 19 ✓")
    two = conversation(tok, "sum:4821 + 9", call.replace("12 + 7", "4821+9"), "4830 é", "4830")
    plain_prompt = list(
        tok.apply_chat_template([{"role": "user", "content": "rev:abc"}], add_generation_prompt=True, return_dict=False)
    )
    plain = plain_prompt + tok.encode("cba ü", add_special_tokens=False) + [tok.eos_token_id]
    sequences = [
        scored(*one, vocab=vocab, seed=1, sample_id=0),
        scored(plain, len(plain_prompt), None, vocab=vocab, seed=2, sample_id=1),
        scored(*two, vocab=vocab, seed=3, sample_id=2),
    ]
    assert tok.eos_token_id == tok.pad_token_id
    return sequences, vocab


def actor_objective(vocab: int, *overrides: str) -> ActorObjective:
    cfg = load_config(None, list(overrides))
    layout = ParallelLayout()
    return ActorObjective(
        cfg, vocab, layout, torch.device("cpu"), tp_group=None, pp_group=None, dp_group=None, **kinds(cfg)
    )  # type: ignore[arg-type]


def logits_for(micro_shape: tuple[int, int], vocab: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return (torch.randn(*micro_shape, vocab) * 2).requires_grad_(True)


# ----------------------------------------------------------------------------- float64 references from full logits


def reference_sum(micro, logits_BTV: torch.Tensor, divergence: str, beta: float = 0.5) -> float:
    """Sum over the loss positions of the divergence over the teacher's K + 1 outcomes (top-k + tail; JSD with
    TRL's endpoints: beta KL(T || M) + (1 - beta) KL(S || M), M = beta T + (1 - beta) S), or of the sampled-token
    surrogate -exp(log s - log s_old) (log t - log s_old), in float64 from the whole vocabulary."""
    logp_BTV = torch.log_softmax(logits_BTV.detach().double(), dim=-1)
    total = 0.0
    for b, t in micro.loss_mask_BT.nonzero().tolist():
        logp_V = logp_BTV[b, t]
        if divergence == "sampled_reverse_kl":
            old = float(micro.rollout_logprobs_BT[b, t])
            logp = float(logp_V[micro.target_ids_BT[b, t]])
            total += -np.exp(logp - old) * (float(micro.teacher_sampled_BT[b, t]) - old)
            continue
        ids = micro.teacher_ids_BTK[b, t]
        student = torch.cat([logp_V[ids], torch.log1p(-logp_V[ids].exp().sum())[None]])
        teacher = torch.cat([micro.teacher_logprobs_BTK[b, t].double(), micro.teacher_tail_BT[b, t].double()[None]])
        if divergence == "forward_kl":
            total += float((teacher.exp() * (teacher - student)).sum())
        elif divergence == "reverse_kl":
            total += float((student.exp() * (student - teacher)).sum())
        else:
            mixture = torch.log(beta * teacher.exp() + (1 - beta) * student.exp())
            total += beta * float((teacher.exp() * (teacher - mixture)).sum())
            total += (1 - beta) * float((student.exp() * (student - mixture)).sum())
    return total


# ----------------------------------------------------------------------------- collate


def test_collate_attends_the_tool_tokens_and_trains_the_sampled_ones(batch: tuple[list[ScoredSequence], int]) -> None:
    sequences, _ = batch
    micro = collate(sequences, pad_id=0)
    for b, seq in enumerate(sequences):
        n, rs = seq.num_response_tokens, seq.response_start
        # Every token, sampled or not, is in the model's input (attended); only sampled ones are predicted for loss.
        np.testing.assert_array_equal(micro.input_ids_BT[b, : len(seq.input_ids) - 1].numpy(), seq.input_ids[:-1])
        np.testing.assert_array_equal(micro.loss_mask_BT[b, rs - 1 : rs - 1 + n].numpy(), seq.sampled_rows())
        np.testing.assert_array_equal(micro.sampled_mask_BT[b, rs - 1 : rs - 1 + n].numpy(), seq.sampled_rows())
        assert not micro.loss_mask_BT[b, : rs - 1].any() and not micro.loss_mask_BT[b, rs - 1 + n :].any()
        assert micro.sampled_mask_BT[b, : rs - 1].all() and micro.sampled_mask_BT[b, rs - 1 + n :].all()
    assert micro.sampled_mask_BT[1].all(), "a sequence without a mask: all sampled"
    assert (
        micro.num_tokens == sum(s.num_sampled_tokens for s in sequences) < sum(s.num_response_tokens for s in sequences)
    )
    assert micro.num_tokens == sum(trained_tokens(s, True) for s in sequences)
    # The ablation (algorithm.mask_tool_tokens=false): every response token trained; the truth kept.
    every = collate(sequences, pad_id=0, mask_tool_tokens=False)
    assert (
        every.num_tokens
        == sum(s.num_response_tokens for s in sequences)
        == sum(trained_tokens(s, False) for s in sequences)
    )
    assert torch.equal(every.sampled_mask_BT, micro.sampled_mask_BT)
    with pytest.raises(ValueError, match="sampled_mask must be bool"):
        collate([dataclasses.replace(sequences[0], sampled_mask=sequences[0].sampled_rows()[1:])], pad_id=0)


# ----------------------------------------------------------------------------- every loss


LOSSES = [
    ("forward_kl", []),
    ("reverse_kl", ["algorithm.divergence=reverse_kl"]),
    ("jsd", ["algorithm.divergence=jsd", "algorithm.beta=0.3"]),
    ("sampled_reverse_kl", ["algorithm.divergence=sampled_reverse_kl"]),
    ("sampled_reverse_kl", ["algorithm.divergence=sampled_reverse_kl", "teacher.top_k=0"]),
    ("hidden_forward_kl", []),
]


def _loss(objective: ActorObjective, micro, logits_BTV: torch.Tensor, name: str):
    """(loss sum, logged sums) of the training loss; teacher.output=hidden with a random teacher head of its own."""
    if name != "hidden_forward_kl":
        loss_sum, _, logged = objective.train_loss(micro, logits_BTV)
        return loss_sum, logged
    return hidden_target(objective).loss_sum(objective, logits_BTV, micro, "forward_kl")[0], {}


def hidden_target(objective: ActorObjective) -> Hidden:
    """teacher.output=hidden with a random teacher head over the student's vocabulary (what setup_actor loads)."""
    target = Hidden(load_config(None, ["teacher.output=hidden"]))
    generator = torch.Generator().manual_seed(7)
    target.head_vH = torch.randn(objective.vocab_size, HIDDEN, generator=generator) * 0.3
    target.shard = slice(0, objective.vocab_size)
    return target


@pytest.mark.parametrize(("name", "overrides"), LOSSES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(LOSSES)])
def test_every_loss_trains_the_sampled_rows_only(
    batch: tuple[list[ScoredSequence], int], name: str, overrides: list[str]
) -> None:
    """The loss equals the float64 reference over the sampled rows; its gradient at every other position is exactly
    0; other values at the unsampled rows (rollout logprob 0 vs not, other teacher rows) change nothing; and it
    equals the loss of the single-turn sequences made of the sampled rows."""
    sequences, vocab = batch
    objective = actor_objective(vocab, *overrides)
    micro = collate(sequences, pad_id=0)
    logits = logits_for(tuple(micro.input_ids_BT.shape), vocab)
    loss, logged = _loss(objective, micro, logits, name)
    loss.backward()
    grad = logits.grad.clone()  # type: ignore[union-attr]
    if name == "hidden_forward_kl":
        head_vH = hidden_target(objective).head_vH
        assert micro.payload is not None and head_vH is not None
        teacher_BTV = micro.payload.double() @ head_vH.double().T
        want = _full_forward_kl(micro.loss_mask_BT, teacher_BTV, logits)
    else:
        want = reference_sum(micro, logits, name, objective.cfg.algorithm.beta)
    assert loss.item() == pytest.approx(want, rel=RTOL)
    unsampled = ~micro.sampled_mask_BT
    assert unsampled.sum() > 10
    assert (grad[unsampled] == 0).all(), "a gradient reached a token the student did not sample"
    assert (grad[micro.loss_mask_BT].abs().sum(-1) > 0).all()

    other = collate([other_values_off_the_samples(s, 50 + i) for i, s in enumerate(sequences)], pad_id=0)
    logits_other = logits.detach().clone().requires_grad_(True)
    loss_other, logged_other = _loss(objective, other, logits_other, name)
    loss_other.backward()
    assert torch.equal(loss_other, loss)
    assert torch.equal(logits_other.grad, grad)  # type: ignore[arg-type]
    for key, value in logged.items():
        assert torch.equal(logged_other[key], value), key

    if name != "hidden_forward_kl":  # evaluation's sums (the objective's and the forward KL's), same rows
        evaluated = objective.eval_loss(micro, logits.detach())
        evaluated_other = objective.eval_loss(other, logits.detach())
        assert evaluated[1].item() == micro.num_tokens and torch.equal(evaluated[2]["sums"], evaluated_other[2]["sums"])
        assert evaluated[2]["sums"][0].item() == pytest.approx(want, rel=RTOL)
        if objective.target.evaluates_kl():
            assert evaluated[2]["sums"][1].item() == pytest.approx(reference_sum(micro, logits, "forward_kl"), rel=RTOL)

    # The single-turn sequences of the sampled rows, their logits the same rows of `logits`.
    singles = [only_sampled(s, i) for i, s in enumerate(sequences)]
    single = collate(singles, pad_id=0)
    logits_single = torch.zeros(*single.input_ids_BT.shape, vocab)
    logits_single[single.loss_mask_BT] = logits.detach()[micro.loss_mask_BT]
    logits_single.requires_grad_(True)
    loss_single, logged_single = _loss(objective, single, logits_single, name)
    loss_single.backward()
    assert single.num_tokens == micro.num_tokens
    assert loss_single.item() == pytest.approx(loss.item(), rel=RTOL)
    torch.testing.assert_close(logits_single.grad[single.loss_mask_BT], grad[micro.loss_mask_BT])  # type: ignore[index]
    for key, value in logged.items():
        torch.testing.assert_close(logged_single[key], value, msg=key)


def _full_forward_kl(mask_BT: torch.Tensor, teacher_logits_BTV: torch.Tensor, logits_BTV: torch.Tensor) -> float:
    teacher = torch.log_softmax(teacher_logits_BTV[mask_BT], dim=-1)
    student = torch.log_softmax(logits_BTV.detach().double()[mask_BT], dim=-1)
    return float((teacher.exp() * (teacher - student)).sum())


def test_the_ablation_trains_every_response_token(batch: tuple[list[ScoredSequence], int]) -> None:
    """algorithm.mask_tool_tokens=false: the placeholders enter the sampled-token loss (the trap it demonstrates)."""
    sequences, vocab = batch
    objective = actor_objective(vocab, "algorithm.divergence=sampled_reverse_kl", "algorithm.mask_tool_tokens=false")
    micro = collate(sequences, pad_id=0, mask_tool_tokens=objective.cfg.algorithm.mask_tool_tokens)
    assert micro.num_tokens == sum(s.num_response_tokens for s in sequences)
    logits = logits_for(tuple(micro.input_ids_BT.shape), vocab)
    loss, _ = _loss(objective, micro, logits, "sampled_reverse_kl")
    assert loss.item() == pytest.approx(reference_sum(micro, logits, "sampled_reverse_kl"), rel=RTOL)
    masked = collate(sequences, pad_id=0)
    assert loss.item() != pytest.approx(_loss(objective, masked, logits, "sampled_reverse_kl")[0].item(), rel=1e-3)


def test_the_policy_statistics_count_the_sampled_rows(batch: tuple[list[ScoredSequence], int]) -> None:
    """advantage_mean (the divergence watch's figure) and the ratio over the sampled rows: not a placeholder's."""
    sequences, vocab = batch
    objective = actor_objective(vocab, "algorithm.divergence=sampled_reverse_kl")
    micro = collate(sequences, pad_id=0)
    _, _, logged = objective.train_loss(micro, logits_for(tuple(micro.input_ids_BT.shape), vocab))
    # Each advantage is a float32 difference (as the loss takes it), their sum in float64 in any order.
    advantage = sum(
        float(np.float32(t) - np.float32(r))
        for s in sequences
        for t, r in zip(s.teacher_sampled_logprob[s.sampled_rows()], s.rollout_logprobs[s.sampled_rows()], strict=True)  # type: ignore[index]
    )
    assert logged["policy_sums"][0].item() == pytest.approx(advantage, rel=1e-12)
    assert micro.num_tokens == sum(s.num_sampled_tokens for s in sequences)


def test_cross_tokenizer_spans_refuse_unsampled_tokens(batch: tuple[list[ScoredSequence], int]) -> None:
    """Spans across tokenizers do not handle a tool's tokens yet: the loss refuses them, it never trains on them."""
    sequences, vocab = batch
    cfg = load_config(None, ["algorithm.cross_tokenizer=span"])
    target = build_target(cfg)
    with_spans = [dataclasses.replace(s, payload=Spans(np.ones(s.num_response_tokens, np.int32))) for s in sequences]
    micro = collate(with_spans, pad_id=0)
    objective = actor_objective(vocab)
    with pytest.raises(ValueError, match=r"algorithm\.cross_tokenizer.*did not sample"):
        target.loss_sum(objective, logits_for(tuple(micro.input_ids_BT.shape), vocab), micro, "forward_kl")
    with pytest.raises(ValueError, match=r"algorithm\.cross_tokenizer.*did not sample"):
        target.sampled_inputs(micro)
    single = collate([with_spans[1]], pad_id=0)  # no mask: accepted
    target.sampled_inputs(single)


# ----------------------------------------------------------------------------- every metric


def test_rollout_stats_count_the_sampled_rows_only(batch: tuple[list[ScoredSequence], int]) -> None:
    """Token counts, the teacher's top-k mass, the logprob sums (the KL estimate), per teacher: the sampled rows only,
    equal to the single-turn sequences made of them; other values at the other rows change nothing."""
    sequences, _ = batch
    stats = summarize(3, 1, sequences, {})
    single = summarize(3, 1, [only_sampled(s, i) for i, s in enumerate(sequences)], {})
    other = summarize(3, 1, [other_values_off_the_samples(s, 90 + i) for i, s in enumerate(sequences)], {})
    for key in STATS_FIGURES:
        assert getattr(stats, key) == pytest.approx(getattr(single, key), rel=1e-12), key
        assert getattr(other, key) == getattr(stats, key), key
    assert stats.per_teacher["default"] == pytest.approx(single.per_teacher["default"], rel=1e-12)
    assert stats.per_teacher == other.per_teacher
    assert stats.num_response_tokens == stats.onpolicy_tokens == sum(s.num_sampled_tokens for s in sequences)
    # The sampled-token KL estimate: mean(log s - log t) over the sampled rows, not over placeholders.
    rows = [(s.rollout_logprobs[s.sampled_rows()], s.teacher_sampled_logprob[s.sampled_rows()]) for s in sequences]
    student = sum(float(r.astype(np.float64).sum()) for r, _ in rows)
    assert stats.rollout_logprob_sum == pytest.approx(student, rel=1e-12)
    json.dumps(dataclasses.asdict(stats))  # what crosses to the driver stays plain
