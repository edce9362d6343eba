"""GKD losses between the student and the teacher (pure torch).

- :mod:`~recipe_gkd.losses.topk`: forward KL, reverse KL and JSD over the teacher's top-k plus
  one tail bucket (or renormalised over the top-k), whole-vocabulary or vocabulary-parallel.
- :mod:`~recipe_gkd.losses.sampled`: the sampled-token reverse KL (on-policy distillation), one
  teacher logprob per sampled token, a policy-gradient step.
- :mod:`~recipe_gkd.losses.student_logits`: the chunked autograd Function both use, which never
  copies or upcasts the student's [B, T, V] logits as a whole, and the tensor-parallel combine.
- :mod:`~recipe_gkd.losses.hidden`: forward KL, reverse KL and JSD exact over the whole
  vocabulary, the teacher's logits computed chunk by chunk from its final hidden states and
  output head (teacher.output=hidden).
- :mod:`~recipe_gkd.losses.cross_tokenizer`: a teacher of another tokenizer, per aligned span
  (algorithm.cross_tokenizer: span log-probabilities, shared pieces, ULD).
- :mod:`~recipe_gkd.losses.checks`: the input checks.
"""

from recipe_gkd.losses.checks import DIVERGENCES, LOGPROB_SLACK, Divergence
from recipe_gkd.losses.cross_tokenizer import cross_tokenizer_loss_sum, span_advantages
from recipe_gkd.losses.hidden import hidden_chunk_size, hidden_gkd_loss_sum
from recipe_gkd.losses.sampled import SampledKLStats, sampled_reverse_kl_loss_sum
from recipe_gkd.losses.student_logits import DEFAULT_CHUNK_BYTES, default_chunk_size
from recipe_gkd.losses.topk import (
    TEACHER_TAIL_LOGPROB_FLOOR,
    gkd_loss,
    gkd_loss_sum,
    topk_divergence,
    vocab_parallel_gkd_loss_sum,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DIVERGENCES",
    "LOGPROB_SLACK",
    "TEACHER_TAIL_LOGPROB_FLOOR",
    "Divergence",
    "SampledKLStats",
    "cross_tokenizer_loss_sum",
    "default_chunk_size",
    "gkd_loss",
    "gkd_loss_sum",
    "hidden_chunk_size",
    "hidden_gkd_loss_sum",
    "sampled_reverse_kl_loss_sum",
    "span_advantages",
    "topk_divergence",
    "vocab_parallel_gkd_loss_sum",
]
