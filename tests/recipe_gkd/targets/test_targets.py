"""Target kinds (recipe_gkd/targets) and teacher handles (teachers_config.TeacherHandle), each chosen once.

- the registry builds one class per kind from the config, and the sampled-token objective is chosen beside it;
- each kind's request and reply: union names the student's ids and merges them, hidden states must be there,
  across tokenizers the scorer must score records; its payload and the metric columns its replies allow;
- payloads collate at the loss positions (row j of a response at position response_start + j - 1), one kind per
  micro-batch, rows checked against the response;
- a teacher handle names keys, files, logs, errors and metric columns exactly as the run did before handles
  (the names users and tests read), for `teacher:`, one teacher under `teachers:`, and several.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from recipe_gkd.actor.collate import collate
from recipe_gkd.batch import ScoredSequence
from recipe_gkd.config import CONFIG_DIR, load_config
from recipe_gkd.config.teachers import chosen_teacher, split_teachers, teacher_handles
from recipe_gkd.cross_tokenizer.span_scores import AlignedScores
from recipe_gkd.targets import Target, build_target
from recipe_gkd.targets.hidden import Hidden, HiddenStates
from recipe_gkd.targets.objectives import SampledReverseKL, TargetDivergence, build_objective
from recipe_gkd.targets.spans import CrossTokenizerSpans, Spans
from recipe_gkd.targets.topk import TopK
from recipe_gkd.targets.union import UnionSupport
from teacher_server.wire.protocol import TeacherScores

TWO = CONFIG_DIR / "presets" / "cpu_two_teachers.yaml"
PAD, VOCAB, TOP_K, HIDDEN = 0, 50, 4, 6


@pytest.mark.parametrize(
    ("overrides", "kind", "topk", "logprobs"),
    [
        ([], TopK, True, True),
        (["teacher.top_k=0", "algorithm.divergence=sampled_reverse_kl"], TopK, False, True),
        (["algorithm.support=union", "rollout.student_top_k=4"], UnionSupport, True, True),
        (["teacher.output=hidden"], Hidden, False, False),
        (["algorithm.cross_tokenizer=span"], CrossTokenizerSpans, False, True),
        (["algorithm.cross_tokenizer=uld"], CrossTokenizerSpans, False, True),
    ],
    ids=["topk", "topk0_sampled", "union", "hidden", "span", "uld"],
)
def test_one_class_per_kind_and_the_columns_its_replies_allow(
    overrides: list[str], kind: type[Target], topk: bool, logprobs: bool
) -> None:
    cfg = load_config(None, overrides)
    target = build_target(cfg)
    assert type(target) is kind
    # teacher_topk_mass: a top-k over the student's vocabulary travels; teacher_sampled_logprob: a logprob does.
    assert (target.sends_topk(), target.sends_logprobs()) == (topk, logprobs)
    sampled = "algorithm.divergence=sampled_reverse_kl" in overrides
    assert type(build_objective(cfg)) is (SampledReverseKL if sampled else TargetDivergence)
    assert build_objective(cfg).policy_statistics == sampled
    assert target.evaluates_kl() == (kind is Hidden or cfg.teacher.top_k > 0)
    assert target.teacher_on_actor == (kind is Hidden)
    assert target.request_options(cfg) == (
        {"top_k": 0, "hidden_dtype": cfg.teacher.client.hidden_dtype}
        if kind is Hidden
        else {"top_k": cfg.teacher.top_k, "hidden_dtype": ""}
    )


class _Scorer:
    """A teacher over a fixed random distribution per position: top-k, exact tail, logprobs at named ids."""

    def __init__(self, hidden: bool = False) -> None:
        self.hidden = hidden
        self.named: list[np.ndarray] | None = None

    def score(
        self, sequences: list[np.ndarray], score_from: list[int], named_ids: list[np.ndarray] | None = None
    ) -> list[TeacherScores]:
        self.named = named_ids
        out = []
        for i, (seq, start) in enumerate(zip(sequences, score_from, strict=True)):
            n = len(seq) - start
            logits_NV = np.random.default_rng(i).standard_normal((n, VOCAB)) * 2
            lp_NV = logits_NV - np.logaddexp.reduce(logits_NV, axis=1, keepdims=True)
            ids_NK = np.argsort(-lp_NV, axis=1)[:, :TOP_K].astype(np.int32)
            top_NK = np.take_along_axis(lp_NV, ids_NK, 1)
            tail_N = np.log1p(-np.exp(np.logaddexp.reduce(top_NK, axis=1)))
            reply = TeacherScores(top_NK.astype(np.float32), ids_NK, lp_NV[:, 0].astype(np.float32), tail_N)
            if named_ids is not None:
                outside = np.ones_like(lp_NV, dtype=bool)
                np.put_along_axis(outside, ids_NK.astype(np.int64), False, 1)
                np.put_along_axis(outside, named_ids[i].astype(np.int64), False, 1)
                reply = dataclasses.replace(
                    reply,
                    named_logprobs=np.take_along_axis(lp_NV, named_ids[i].astype(np.int64), 1).astype(np.float32),
                    other_logmass=np.logaddexp.reduce(np.where(outside, lp_NV, -np.inf), axis=1),
                )
            if self.hidden:
                reply = dataclasses.replace(reply, hidden_states=np.ones((n, HIDDEN), np.float32))
            out.append(reply)
        return out


def test_union_names_the_students_ids_and_each_id_is_one_outcome() -> None:
    cfg = load_config(None, ["algorithm.support=union", "rollout.student_top_k=3"])
    target, scorer = build_target(cfg), _Scorer()
    seq = np.arange(1, 9, dtype=np.int32)
    # 5 scored positions from 3; the student's first id is the teacher's top-1 (one outcome, counted once).
    top1_N = _Scorer().score([seq], [3])[0].topk_ids[:, 0]
    student_NS = np.stack([top1_N, (top1_N + 1) % VOCAB, (top1_N + 2) % VOCAB], axis=1).astype(np.int64)
    (merged,) = target.score(scorer, [seq], [3], [student_NS], None)
    assert scorer.named is not None and scorer.named[0].dtype == np.int32
    np.testing.assert_array_equal(scorer.named[0], student_NS)
    # K + k_s columns; the masses of the teacher's ids, the student's new ids and the rest sum to one.
    assert merged.topk_ids.shape == (5, TOP_K + 3)
    assert (merged.topk_ids[:, TOP_K] == -1).all() and np.isneginf(merged.topk_logprobs[:, TOP_K]).all()
    total = np.logaddexp(np.logaddexp.reduce(merged.topk_logprobs.astype(np.float64), axis=1), merged.tail_logmass)
    np.testing.assert_allclose(total, 0.0, atol=1e-5)
    with pytest.raises(ValueError, match=r"algorithm\.lmbda must be 1"):
        target.score(scorer, [seq], [3], [None], None)
    with pytest.raises(ValueError, match=r"rollout\.student_top_k"):
        target.score(scorer, [seq], [3], [student_NS[:, :2]], None)


def test_hidden_states_must_come_back_and_become_the_payload() -> None:
    target = build_target(load_config(None, ["teacher.output=hidden"]))
    seq = np.arange(1, 7, dtype=np.int32)
    with pytest.raises(ValueError, match="no hidden states"):
        target.score(_Scorer(hidden=False), [seq], [2], [None], None)
    (reply,) = target.score(_Scorer(hidden=True), [seq], [2], [None], None)
    payload = target.payload(reply, "default")
    assert isinstance(payload, HiddenStates) and payload.rows() == 4 and payload.counts() == {}
    assert payload.dtype == load_config(None, []).teacher.client.hidden_dtype  # the teacher's wire dtype
    np.testing.assert_array_equal(payload.to_float32(), reply.hidden_states)


def test_across_tokenizers_the_scorer_scores_records_and_the_spans_are_the_payload() -> None:
    target = build_target(load_config(None, ["algorithm.cross_tokenizer=span"]))
    seq = np.arange(1, 7, dtype=np.int32)
    with pytest.raises(ValueError, match="CrossTokenizerScorer"):
        target.score(_Scorer(), [seq], [2], [None], [{"prompt": "x"}])  # a same-tokenizer scorer

    class _Records(_Scorer):
        def score_records(self, sequences, score_from, records):  # type: ignore[no-untyped-def]
            base = self.score(sequences, score_from)[0]
            counts = {"aligned_tokens": 3.0, "response_tokens": 4.0}
            span = np.array([2, 0, 1, -1], np.int32)
            return [AlignedScores(base.topk_logprobs, base.topk_ids, base.sampled_logprob, base.tail_logmass, span_len=span, counts=counts)]  # fmt: skip

    with pytest.raises(ValueError, match="each sequence's record"):
        target.score(_Records(), [seq], [2], [None], None)
    (reply,) = target.score(_Records(), [seq], [2], [None], [{"prompt": "x"}])
    payload = target.payload(reply, "default")
    assert isinstance(payload, Spans) and payload.span_len_N.tolist() == [2, 0, 1, -1]
    assert payload.counts() == {"aligned_tokens": 3.0, "response_tokens": 4.0}
    with pytest.raises(ValueError, match="no spans"):
        target.payload(_Scorer().score([seq], [2])[0], "default")
    assert TopK(load_config(None, [])).payload(reply, "default") is None  # the top-k kind adds nothing


def _sequence(sample_id: int, length: int, start: int, payload: object | None) -> ScoredSequence:
    rng = np.random.default_rng(sample_id)
    n = length - start
    return ScoredSequence(
        sample_id=sample_id,
        input_ids=rng.integers(1, VOCAB, length).astype(np.int32),
        response_start=start,
        on_policy=True,
        teacher_topk_logprobs=-rng.random((n, TOP_K)).astype(np.float32),
        teacher_topk_ids=rng.integers(0, VOCAB, (n, TOP_K)).astype(np.int32),
        teacher_tail_logmass=-rng.random(n).astype(np.float32),
        teacher_sampled_logprob=-rng.random(n).astype(np.float32),
        payload=payload,  # type: ignore[arg-type]
    )


# (length, response_start) of three rows: different prompts, different responses, the longest sets T.
SHAPES = [(9, 3), (6, 4), (12, 2)]


def test_spans_collate_at_the_loss_positions_and_minus_one_elsewhere() -> None:
    spans = [np.random.default_rng(i).integers(-1, 3, length - start).astype(np.int32) for i, (length, start) in enumerate(SHAPES)]  # fmt: skip
    seqs = [_sequence(i, length, start, Spans(s)) for i, ((length, start), s) in enumerate(zip(SHAPES, spans, strict=True))]  # fmt: skip
    micro = collate(seqs, PAD)
    assert micro.payload is not None and micro.payload.dtype == torch.int64
    assert tuple(micro.payload.shape) == (3, 11)
    for b, ((length, start), s) in enumerate(zip(SHAPES, spans, strict=True)):
        want = np.full(11, -1)
        for j in range(length - start):  # response token start + j is predicted at position start + j - 1
            want[start + j - 1] = s[j]
        assert micro.payload[b].tolist() == want.tolist()


def _wire(values_NH: np.ndarray) -> HiddenStates:
    """Hidden states as the client decodes the wire: values of bfloat16, in its 16 bits."""
    from teacher_server.wire import hidden_codec

    return HiddenStates.from_float32(hidden_codec.round_to(values_NH.astype(np.float32), "bfloat16"), "bfloat16")


def test_hidden_states_collate_at_the_loss_positions_and_zero_elsewhere() -> None:
    states = [_wire(np.random.default_rng(i).standard_normal((length - start, HIDDEN))) for i, (length, start) in enumerate(SHAPES)]  # fmt: skip
    seqs = [_sequence(i, length, start, h) for i, ((length, start), h) in enumerate(zip(SHAPES, states, strict=True))]  # fmt: skip
    micro = collate(seqs, PAD)
    assert micro.payload is not None and tuple(micro.payload.shape) == (3, 11, HIDDEN)
    assert micro.payload.dtype == torch.bfloat16
    for b, ((length, start), h) in enumerate(zip(SHAPES, states, strict=True)):
        want = np.zeros((11, HIDDEN), np.float32)
        for j in range(length - start):
            want[start + j - 1] = h.to_float32()[j]
        np.testing.assert_array_equal(micro.payload[b].float().numpy(), want)
    moved = micro.to(torch.device("cpu"))
    assert moved.payload is not None and torch.equal(moved.payload, micro.payload)
    assert collate([_sequence(0, 9, 3, None)], PAD).payload is None


def test_a_micro_batch_holds_one_kind_of_payload_with_a_row_per_response_token() -> None:
    spans = Spans(np.ones(6, np.int32))
    with pytest.raises(ValueError, match="different target payloads"):
        collate([_sequence(0, 9, 3, spans), _sequence(1, 9, 3, None)], PAD)
    with pytest.raises(ValueError, match=r"sample 0: its Spans payload has 5 rows .* 6 response tokens"):
        collate([_sequence(0, 9, 3, Spans(np.ones(5, np.int32)))], PAD)
    wide = [_wire(np.zeros((6, HIDDEN))), _wire(np.zeros((6, HIDDEN + 1)))]
    with pytest.raises(ValueError, match=r"teacher\.output"):
        collate([_sequence(i, 9, 3, w) for i, w in enumerate(wide)], PAD)


def _one_named(tmp_path: Path) -> Path:
    raw = OmegaConf.load(CONFIG_DIR / "presets" / "cpu_demo.yaml")
    raw["teachers"] = {"solo": raw.pop("teacher")}
    path = tmp_path / "solo.yaml"
    OmegaConf.save(raw, path)
    return path


def test_a_teacher_handle_names_everything_as_the_run_did(tmp_path: Path) -> None:
    (single,) = teacher_handles(load_config(None, [])).values()
    assert (single.name, single.key("address"), single.log_name, single.file_suffix) == (
        "default",
        "teacher.address",
        "teacher_server.log",
        "",
    )
    assert (single.who, single.server, single.label, single.replica_logs) == (
        "the teacher",
        "teacher server",
        "teacher",
        "teacher_logs",
    )
    assert (single.error_prefix, single.metric_prefix, single.row_name) == ("", None, None)

    (solo,) = teacher_handles(load_config(_one_named(tmp_path))).values()
    assert (solo.key("top_k"), solo.log_name, solo.who, solo.server, solo.label, solo.replica_logs) == (
        "teachers.solo.top_k",
        "teacher_server.solo.log",
        "teacher 'solo'",
        "teacher 'solo' server",
        "teacher solo",
        "teacher_logs/solo",
    )
    # One teacher under `teachers:`: no per-teacher metric columns and no name in its errors, but its rows name it.
    assert (solo.error_prefix, solo.metric_prefix, solo.row_name) == ("", None, "solo")

    cfg = load_config(TWO)
    handles = teacher_handles(cfg)
    assert list(handles) == ["reverse", "sum"] and handles["sum"].section is cfg.teachers["sum"]
    assert handles["sum"].address == cfg.teachers["sum"].address
    assert (handles["sum"].error_prefix, handles["sum"].metric_prefix) == ("teacher 'sum': ", "teacher_sum_")
    assert split_teachers(cfg) == ["reverse", "sum"] and split_teachers(load_config(_one_named(tmp_path))) == []


def test_the_launch_flag_picks_a_teacher_only_among_several_names(tmp_path: Path) -> None:
    one = load_config(None, [])
    default = teacher_handles(one)["default"]
    assert chosen_teacher(one, "") == chosen_teacher(one, "anything") == default  # `teacher:` ignores the flag
    two = load_config(TWO)
    assert chosen_teacher(two, "") is None and chosen_teacher(two, "nope") is None
    assert chosen_teacher(two, "sum") == teacher_handles(two)["sum"]
    assert chosen_teacher(load_config(_one_named(tmp_path)), "") is None  # under `teachers:` it must be named
