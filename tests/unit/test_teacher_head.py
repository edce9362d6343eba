"""The teacher's output head on the actor (teacher.output=hidden): found, checked and sliced per vocabulary shard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recipe_gkd.actor.teacher_head import find_teacher_head, load_teacher_head_shard
from recipe_gkd.config import ConfigError
from recipe_gkd.tiny_models import TinyModelSpec, build_tiny_causal_lm


def _head(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).get_output_embeddings().weight


@pytest.mark.parametrize("tied", [True, False])
def test_each_shard_holds_the_teachers_head_rows(tmp_path: Path, tied: bool) -> None:
    model_dir = build_tiny_causal_lm(tmp_path / "teacher", seed=2, spec=TinyModelSpec(tie_word_embeddings=tied))
    head_VH = _head(model_dir)
    ref = find_teacher_head(str(model_dir), head_VH.shape[0])
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
    with pytest.raises(ConfigError, match=f"{vocab} rows and the student's vocabulary {vocab + 1}") as err:
        find_teacher_head(str(model_dir), vocab + 1)
    assert err.value.key == "teacher.output"
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "final_logit_softcapping": 30.0}))
    with pytest.raises(ConfigError, match="final_logit_softcapping") as err:
        find_teacher_head(str(model_dir), vocab)
    assert err.value.key == "teacher.output"
