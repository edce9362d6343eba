"""The teacher's output head on the actor (teacher.output=hidden): found, checked and sliced per vocabulary shard."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from target_kinds import kinds

from recipe_gkd.actor.collate import MicroBatch
from recipe_gkd.actor.objective import ActorObjective
from recipe_gkd.actor.teacher_head import find_teacher_head, load_teacher_head_shard, tokenizer_size
from recipe_gkd.config import ConfigError, GKDConfig, load_config
from recipe_gkd.offline_models import TinyModelSpec, build_tiny_causal_lm
from recipe_gkd.parallel_layout import ParallelLayout, padded_vocab_size
from recipe_gkd.preflight import teacher_head as check_teacher_head


def _head(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).get_output_embeddings().weight


@pytest.mark.parametrize("tied", [True, False])
def test_each_shard_holds_the_teachers_head_rows(tmp_path: Path, tied: bool) -> None:
    model_dir = build_tiny_causal_lm(tmp_path / "teacher", seed=2, spec=TinyModelSpec(tie_word_embeddings=tied))
    head_VH = _head(model_dir)
    ref = find_teacher_head(str(model_dir), head_VH.shape[0], tokenizer_size(str(model_dir)))
    assert ref.name == ("model.embed_tokens.weight" if tied else "lm_head.weight")
    assert (ref.vocab_size, ref.hidden_size) == tuple(head_VH.shape)
    split = 37  # uneven shards, like the padded vocabulary's last rank
    shards = [
        load_teacher_head_shard(ref, 0, split, torch.float32, torch.device("cpu")),
        load_teacher_head_shard(ref, split, head_VH.shape[0] - split, torch.float32, torch.device("cpu")),
    ]
    assert torch.equal(torch.cat(shards), head_VH.detach())


def test_a_teacher_with_another_vocabulary_or_a_rescaled_head_is_refused(tmp_path: Path) -> None:
    model_dir = build_tiny_causal_lm(tmp_path / "teacher", seed=2)
    vocab = _head(model_dir).shape[0]
    with pytest.raises(
        ConfigError, match=f"{vocab} rows and the student's {vocab + 1}, fewer than the {vocab + 1} ids"
    ) as err:
        find_teacher_head(str(model_dir), vocab + 1, vocab + 1)
    assert err.value.key == "teacher.output"
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "final_logit_softcapping": 30.0}))
    with pytest.raises(ConfigError, match="final_logit_softcapping") as err:
        find_teacher_head(str(model_dir), vocab, vocab)
    assert err.value.key == "teacher.output"


# Qwen2.5 pads its heads over one tokenizer: 152064 rows from 7B up, 151936 for 0.5B-3B.
QWEN25_LARGE_ROWS, QWEN25_SMALL_ROWS = 152064, 151936
SMALL_QWEN_SHAPE = TinyModelSpec(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)


@pytest.fixture(scope="module")
def qwen25_heads(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Head rows -> a model of that vocabulary over one byte-level ChatML tokenizer (a 7B-shaped untied head,
    a 0.5B-shaped tied one), small hidden sizes."""
    root = tmp_path_factory.mktemp("qwen25_heads")
    return {
        rows: build_tiny_causal_lm(
            root / str(rows),
            seed=rows % 7,
            spec=dataclasses.replace(SMALL_QWEN_SHAPE, vocab_size=rows, tie_word_embeddings=tied),
            tokenizer_kind="chatml_bpe",
        )
        for rows, tied in ((QWEN25_LARGE_ROWS, False), (QWEN25_SMALL_ROWS, True))
    }


def _hidden_cfg(teacher: Path, student: Path, divergence: str = "forward_kl") -> GKDConfig:
    return load_config(
        None,
        [
            "teacher.output=hidden",
            f"teacher.model_path={teacher}",
            f"model.student_path={student}",
            f"algorithm.divergence={divergence}",
            "actor.precision=fp32",
        ],
    )


@pytest.mark.parametrize(
    ("teacher_rows", "student_rows"), [(QWEN25_LARGE_ROWS, QWEN25_SMALL_ROWS), (QWEN25_SMALL_ROWS, QWEN25_LARGE_ROWS)]
)
def test_heads_padded_differently_over_one_tokenizer_compare_the_rows_both_have(
    qwen25_heads: dict[int, Path], teacher_rows: int, student_rows: int
) -> None:
    """A 7B-shaped teacher for a 0.5B-shaped student (and the reverse): the run starts, and the loss is the
    divergence over the ids both heads have, against a float64 reference."""
    teacher, student = qwen25_heads[teacher_rows], qwen25_heads[student_rows]
    cfg = _hidden_cfg(teacher, student)
    check_teacher_head(cfg)  # what the driver checks before Ray starts (it exited 2 here)
    shared = min(teacher_rows, student_rows)
    assert tokenizer_size(str(student)) < shared
    ref = find_teacher_head(str(teacher), student_rows, tokenizer_size(str(student)))
    assert (ref.vocab_size, ref.loss_vocab_size) == (teacher_rows, shared)

    layout = ParallelLayout()
    objective = ActorObjective(
        cfg, student_rows, layout, torch.device("cpu"), tp_group=None, pp_group=None, dp_group=None, **kinds(cfg)
    )  # type: ignore[arg-type]
    head_VH = _head(teacher).detach().double()
    gen = torch.Generator().manual_seed(3)
    batch, seq = 2, 4
    hidden_BTH = torch.randn(batch, seq, SMALL_QWEN_SHAPE.hidden_size, generator=gen) * 4
    logits_BTV = torch.randn(batch, seq, padded_vocab_size(student_rows, 1), generator=gen) * 3
    mask_BT = torch.tensor([[False, True, True, True], [False, False, True, False]])
    micro = _micro(hidden_BTH, mask_BT)
    loss, tokens = objective.loss_sum(logits_BTV, micro)
    log_p = torch.log_softmax(logits_BTV.double()[..., :shared], -1)
    log_q = torch.log_softmax(hidden_BTH.double() @ head_VH[:shared].T, -1)
    want = (log_q.exp() * (log_q - log_p)).sum(-1)[mask_BT].sum()
    # fp32 log-softmax over 1.5e5 ids: ~log2(V) roundings of 6e-8 per term, far below 1e-5 of a sum of 4 KLs ~ 10.
    assert int(tokens) == 4 and loss.item() == pytest.approx(want.item(), rel=1e-5)

    # At TP = 2 the second rank holds the ids [76032, shared) of its padded shard and the teacher's rows for them.
    rank1 = ParallelLayout(tp_size=2, rank=1)
    other = ActorObjective(
        cfg, student_rows, rank1, torch.device("cpu"), tp_group=None, pp_group=None, dp_group=None, **kinds(cfg)
    )  # type: ignore[arg-type]
    start = padded_vocab_size(student_rows, 2) // 2
    assert other.vocab_start == start and other.target.shard == slice(0, shared - start)
    assert other.target.head_vH is not None
    assert torch.equal(other.target.head_vH.double(), head_VH[start:shared])


def test_a_head_shorter_than_the_tokenizer_is_refused(tmp_path: Path, qwen25_heads: dict[int, Path]) -> None:
    student = qwen25_heads[QWEN25_SMALL_ROWS]
    rows = tokenizer_size(str(student)) - 1
    teacher = build_tiny_causal_lm(
        tmp_path / "short",
        seed=1,
        spec=dataclasses.replace(SMALL_QWEN_SHAPE, vocab_size=rows),
        tokenizer_kind="chatml_bpe",
    )
    with pytest.raises(ConfigError, match=f"{rows} rows and the student's {QWEN25_SMALL_ROWS}, fewer than") as err:
        check_teacher_head(_hidden_cfg(teacher, student))
    assert err.value.key == "teacher.output"


def _micro(hidden_BTH: torch.Tensor, mask_BT: torch.Tensor) -> MicroBatch:
    """A micro-batch carrying only what the hidden-state loss reads (the hidden states and the loss mask)."""
    zeros_BT = torch.zeros(mask_BT.shape)
    return MicroBatch(
        input_ids_BT=zeros_BT.long(),
        position_ids_BT=zeros_BT.long(),
        teacher_logprobs_BTK=zeros_BT[..., None],
        teacher_ids_BTK=zeros_BT[..., None].long(),
        teacher_tail_BT=zeros_BT,
        loss_mask_BT=mask_BT,
        num_tokens=int(mask_BT.sum()),
        target_ids_BT=zeros_BT.long(),
        rollout_logprobs_BT=zeros_BT,
        teacher_sampled_BT=zeros_BT,
        sampled_mask_BT=torch.ones(mask_BT.shape, dtype=torch.bool),
        payload=hidden_BTH * mask_BT[..., None],
    )
