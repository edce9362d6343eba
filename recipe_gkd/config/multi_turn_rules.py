"""The rules of multi-turn rollouts (`rollout.env`): what they combine with, and their bounds.

Called from rules.validate(); each refusal names the key to change (docs/multi_turn.md).
"""

from __future__ import annotations

from recipe_gkd.config.schema import CrossTokenizer, GKDConfig, Support
from recipe_gkd.envs.registry import ENVIRONMENTS, is_import_path
from recipe_gkd.teacher_prompt import prompt_rule
from teacher_server.config.fields import require


def validate_multi_turn(cfg: GKDConfig) -> None:
    """rollout.env: a known environment, one teacher that scores the student's own conversation, sampled turns only."""
    r = cfg.rollout
    if not r.env:
        return
    # A class of one's own (package.module:Class) is imported where it is built (the driver's preflight), not here:
    # a dry run validates on any machine.
    require(
        r.env in ENVIRONMENTS or is_import_path(r.env),
        "rollout.env",
        f"unknown environment {r.env!r}; known environments: {', '.join(sorted(ENVIRONMENTS))}, or your own class "
        "as package.module:Class (empty: single-turn)",
    )
    teacher_prompt = prompt_rule(cfg.data, cfg.teacher, "teacher")
    refusals = (
        (
            cfg.algorithm.cross_tokenizer == CrossTokenizer.none,
            "algorithm.cross_tokenizer",
            "multi-turn rollouts (rollout.env) are scored in the student's tokens only: set it to none",
        ),
        (
            not cfg.teachers,
            "teachers",
            "multi-turn rollouts (rollout.env) take one teacher: configure `teacher:` instead of `teachers:`",
        ),
        (
            not teacher_prompt.privileged,
            teacher_prompt.key if teacher_prompt.privileged else "data.teacher_prompt_key",
            "gives the teacher a prompt of its own, not supported with multi-turn rollouts (rollout.env): the "
            "teacher scores the student's conversation; clear it",
        ),
        (
            cfg.algorithm.lmbda == 1.0,
            "algorithm.lmbda",
            f"is {cfg.algorithm.lmbda}: dataset responses (lmbda < 1) are single-turn; multi-turn rollouts "
            "(rollout.env) are all sampled by the student: set it to 1.0",
        ),
        (
            cfg.algorithm.support != Support.union and r.student_top_k == 0,
            "algorithm.support",
            "union needs the student's top-k at every response position, and tool tokens have none: "
            "with rollout.env use teacher_topk (and rollout.student_top_k=0)",
        ),
        (
            cfg.data.apply_chat_template,
            "data.apply_chat_template",
            "is false: multi-turn rollouts (rollout.env) render the conversation with the chat template",
        ),
        (
            r.max_total_tokens > cfg.data.max_prompt_length,
            "rollout.max_total_tokens",
            f"is {r.max_total_tokens}, not above data.max_prompt_length={cfg.data.max_prompt_length}: "
            "no room for a turn; raise it",
        ),
    )
    for ok, key, message in refusals:
        require(ok, key, message)
