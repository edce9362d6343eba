"""Tiny students that end their turns as real checkpoints do: shaped like Qwen3-*-Base (EOS `<|endoftext|>`, a ChatML
template closing turns with `<|im_end|>`) and Llama 3.1 Instruct (generation_config.json's eos list, `<|eom_id|>`),
their head biased to emit one token often, so a response meets it mid-way (an engine that ignores it samples on)."""

from __future__ import annotations

from pathlib import Path

import torch

from recipe_gkd.offline_models import TinyModelSpec, build_tiny_causal_lm

# An untied head, so biasing one output row leaves the input embeddings alone.
SPEC = TinyModelSpec(tie_word_embeddings=False)
# The biased row: `BIAS_SCALE` x the unit mean direction of the final hidden states. Measured on the Qwen3-Base-shaped
# student at temperature 1: of 16 responses of at most 16 tokens, 12 met the token after 1-8 tokens and 4 ran to the
# limit (scale 1.0: 15 of 16 ran to it; 2.5: most stopped at once). Greedy decoding picks it first.
BIAS_SCALE = 2.0
PROBE_SEQUENCES, PROBE_LENGTH = 16, 32


def bias_toward(model_dir: Path, token: str, scale: float = BIAS_SCALE) -> int:
    """Rewrite `model_dir`'s lm_head row of `token` to point along its hidden states' mean; returns its id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    token_id = int(tokenizer.convert_tokens_to_ids(token))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(tokenizer), (PROBE_SEQUENCES, PROBE_LENGTH), generator=generator)
    with torch.no_grad():
        hidden_ND = model.model(input_ids=ids).last_hidden_state.reshape(-1, model.config.hidden_size)
        mean_D = hidden_ND.mean(0)
        model.lm_head.weight[token_id] = scale * mean_D / mean_D.norm()
    model.save_pretrained(str(model_dir), safe_serialization=True)
    return token_id


def biased_student(out_dir: Path, tokenizer_kind: str, token: str, seed: int = 0) -> Path:
    """A tiny student of `tokenizer_kind` (offline_models.TOKENIZERS) that emits `token` often."""
    build_tiny_causal_lm(out_dir, seed=seed, spec=SPEC, tokenizer_kind=tokenizer_kind)
    bias_toward(out_dir, token)
    return out_dir
