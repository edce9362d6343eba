"""What the student writes, for a person to read: a few sampled responses per logged step in samples.jsonl.

The rollout worker (rank 0) decodes the first trainer.log_samples sequences of a step it logs (`samples_due`) and
hands them to the driver in its RolloutStats; the driver writes one row per sample. A row: the step, the sample id,
the prompt and response text (special tokens kept, so a turn end shows), the response ids, how it ended (`stop
'<|im_end|>' (151645)`, or `length` when rollout.sampling.max_new_tokens cut it; a conversation's ending and its last
turn's), its reward, the teacher's mean logprob over the tokens the student sampled, and where it came from.
"""

from __future__ import annotations

from typing import Any

SAMPLES_FILE = "samples.jsonl"


def samples_due(log_samples: int, every: int, eval_every: int, step: int) -> bool:
    """Whether batch `step` (0-based) logs samples: the first, then every `every` steps (0: eval_every's)."""
    if log_samples == 0:
        return False
    period = every or eval_every
    return step == 0 or (period > 0 and (step + 1) % period == 0)


def sample_row(
    *,
    sample_id: int,
    prompt: str,
    response: str,
    response_ids: list[int],
    ended: str,
    reward: float | None,
    teacher_mean_logprob: float | None,
    on_policy: bool,
    teacher: str,
) -> dict[str, Any]:
    """One row of samples.jsonl (the driver adds the step)."""
    return {
        "sample_id": sample_id,
        "prompt": prompt,
        "response": response,
        "response_ids": response_ids,
        "ended": ended,
        "reward": reward,
        "teacher_mean_logprob": teacher_mean_logprob,
        "on_policy": on_policy,
        "teacher": teacher,
    }
