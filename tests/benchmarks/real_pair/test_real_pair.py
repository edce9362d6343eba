"""The real-pair benchmark's own logic: ROUGE-L by hand, the choice of layers and depth pruning on a tiny model."""

from __future__ import annotations

import pytest
import torch

from benchmarks.real_pair.prompts import all_prompts, generate_prompts
from benchmarks.real_pair.pruning import kept_layers, prune_model, pruned_state_dict
from benchmarks.real_pair.rouge import lcs_length, rouge_l, words
from recipe_gkd.offline_models import TinyModelSpec, build_tiny_causal_lm


def test_rouge_l_matches_hand_computed_examples() -> None:
    # Lin (2004), section 3.1: reference "police killed the gunman".
    # "police kill the gunman": LCS "police the gunman" = 3 of 4 and 4 words -> P = R = F = 3/4.
    assert rouge_l("police kill the gunman", "police killed the gunman").f1 == pytest.approx(0.75)
    # "the gunman kill police": LCS "the gunman" = 2 -> F = 1/2.
    assert rouge_l("the gunman kill police", "police killed the gunman").f1 == pytest.approx(0.5)
    # Unequal lengths: candidate a b c d e f, reference a c f: LCS 3, P = 3/6, R = 3/3, F = 2PR/(P+R) = 2/3.
    score = rouge_l("a b c d e f", "a c f")
    assert (score.precision, score.recall, score.f1) == pytest.approx((0.5, 1.0, 2 / 3))
    # Case and punctuation are not words.
    assert rouge_l("The Cat, sat.", "the cat sat").f1 == pytest.approx(1.0)
    assert rouge_l("", "the cat").f1 == 0.0 and rouge_l("dog", "the cat").f1 == 0.0


def test_lcs_is_a_subsequence_length_not_a_substring_length() -> None:
    assert lcs_length(list("ABCBDAB"), list("BDCABA")) == 4  # CLRS's example: BCBA
    assert lcs_length(list("BDCABA"), list("ABCBDAB")) == 4
    assert words("It's 3 o'clock!") == ["it", "s", "3", "o", "clock"]


def test_kept_layers_every_other_and_ends() -> None:
    assert kept_layers(30, 15, "every_other") == list(range(0, 30, 2))
    assert kept_layers(30, 15, "ends") == [*range(8), *range(23, 30)]
    assert kept_layers(4, 2, "ends") == [0, 3] and kept_layers(4, 2, "every_other") == [0, 2]
    assert kept_layers(5, 5, "ends") == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="keep=0"):
        kept_layers(4, 0, "ends")
    with pytest.raises(ValueError, match="unknown pruning strategy"):
        kept_layers(4, 2, "middle")


def test_pruned_student_computes_the_teacher_with_only_the_kept_layers(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    spec = TinyModelSpec(hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4, num_kv_heads=2)
    build_tiny_causal_lm(tmp_path / "teacher", seed=3, spec=spec)
    teacher = AutoModelForCausalLM.from_pretrained(str(tmp_path / "teacher"), dtype=torch.float32).eval()
    keep = [0, 3]
    student = prune_model(teacher, keep)
    assert student.config.num_hidden_layers == 2 and len(student.model.layers) == 2
    state = student.state_dict()
    assert torch.equal(
        state["model.layers.1.mlp.up_proj.weight"], teacher.state_dict()["model.layers.3.mlp.up_proj.weight"]
    )
    assert not any(k.startswith("model.layers.2.") for k in pruned_state_dict(teacher.state_dict(), keep))
    # The student's logits are the teacher's run through layers 0 and 3 only.
    input_ids = torch.randint(0, teacher.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    full = teacher.model.layers
    with torch.no_grad():
        teacher.model.layers = torch.nn.ModuleList([full[i] for i in keep])
        expected = teacher(input_ids=input_ids, use_cache=False).logits
        teacher.model.layers = full
        got = student(input_ids=input_ids, use_cache=False).logits
        unpruned = teacher(input_ids=input_ids, use_cache=False).logits
    assert torch.equal(got, expected)
    assert not torch.allclose(got, unpruned)
    # The student owns its tensors; tied embeddings stay tied.
    assert student.lm_head.weight.data_ptr() == student.model.embed_tokens.weight.data_ptr()
    assert student.model.embed_tokens.weight.data_ptr() != teacher.model.embed_tokens.weight.data_ptr()
    student.save_pretrained(str(tmp_path / "student"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "student"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=input_ids, use_cache=False).logits, got)


def test_prompts_are_distinct_and_the_same_for_a_seed() -> None:
    assert len(set(all_prompts())) == len(all_prompts()) > 400
    assert generate_prompts(50, 7) == generate_prompts(50, 7) != generate_prompts(50, 8)
    with pytest.raises(ValueError, match="templates make"):
        generate_prompts(len(all_prompts()) + 1, 1)
