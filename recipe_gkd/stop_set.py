"""Where a response ends: the tokenizer's EOS, generation_config.json's eos ids and the chat template's turn end.

A model's EOS is not always the token its chat template closes an assistant turn with: Qwen2.5/Qwen3 *-Base*
checkpoints ship EOS `<|endoftext|>` with a ChatML template that closes turns with `<|im_end|>`; Llama 3.1
Instruct's tokenizer says `<|eot_id|>` while its generation_config.json lists 128001, 128008 (`<|eom_id|>`, after a
tool call) and 128009. A rollout that stops at the EOS alone samples past the end of the turn, and the teacher
scores and the actor trains the text after it. So every engine (HF and vLLM; single- and multi-turn; training and
evaluation) stops at one `StopSet`, built once per tokenizer by `stop_set_of`:

1. the tokenizer's EOS;
2. every id of `generation_config.json`'s `eos_token_id` (an int or a list);
3. where the chat template is used, the special token that closes an assistant turn, found by rendering a
   one-message conversation and taking the first special token after the message's content.

The stop id is kept as the response's last token: it is trained and scored as the template closes the turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recipe_gkd.config import ConfigError, GKDConfig

GENERATION_CONFIG = "generation_config.json"
# How a response the length limit cut "ended" (StopSet.ending).
LENGTH_ENDING = "length"
# The assistant message rendered to find the template's turn end: plain words no template rewrites.
PROBE_CONTENT = "The answer is forty two."
PROBE_CONVERSATION = [
    {"role": "user", "content": "What is six times seven?"},
    {"role": "assistant", "content": PROBE_CONTENT},
]


class TurnEndError(ValueError):
    """The chat template's end of an assistant turn cannot be found (the message names the tokenizer)."""


@dataclass(frozen=True)
class StopSet:
    """The ids a sampled response ends at, and where each comes from."""

    eos: int | None
    """The tokenizer's EOS (`eos_token_id`)."""
    config_eos: tuple[int, ...]
    """generation_config.json's `eos_token_id`, in its order (empty without the file or the field)."""
    turn_end: int | None
    """The special token the chat template closes an assistant turn with (None: no template used, or it closes
    turns with no special token)."""
    names: tuple[tuple[int, str], ...] = ()
    """(id, token text) of every id above, for messages."""

    @property
    def ids(self) -> tuple[int, ...]:
        """Every stop id, sorted, each once."""
        found = {*self.config_eos, *(i for i in (self.eos, self.turn_end) if i is not None)}
        return tuple(sorted(found))

    @property
    def closing_id(self) -> int | None:
        """The id a turn is closed with where the run writes one itself (a dataset's reference response): the
        template's turn end, else the EOS."""
        return self.turn_end if self.turn_end is not None else self.eos

    def end(self, ids: list[int]) -> tuple[int, int | None]:
        """(length, stop id) of a sampled response: up to and including its first stop id; (len(ids), None) when
        none occurs (cut by the length limit)."""
        stops = set(self.ids)
        for position, token in enumerate(ids):
            if token in stops:
                return position + 1, token
        return len(ids), None

    def name(self, token: int) -> str:
        return dict(self.names).get(token, str(token))

    def ending(self, stop_id: int | None) -> str:
        """How a sampled response ended, for a person to read: `stop '<|im_end|>' (151645)`, or `length` when the
        length limit cut it (samples.jsonl's `ended`)."""
        return LENGTH_ENDING if stop_id is None else f"stop {self.name(stop_id)!r} ({stop_id})"

    def describe(self) -> str:
        """Each stop id with its token and its source, e.g. `<|im_end|>` (7: the chat template's turn end)."""
        parts = []
        for token in self.ids:
            sources = [
                label
                for label, hit in (
                    ("the tokenizer's EOS", token == self.eos),
                    ("generation_config.json", token in self.config_eos),
                    ("the chat template's turn end", token == self.turn_end),
                )
                if hit
            ]
            parts.append(f"{self.name(token)!r} ({token}: {', '.join(sources)})")
        return ", ".join(parts) if parts else "none"


def config_eos_ids(model_dir: str | Path | None) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (an int or a list) in `model_dir`; () without the file or field."""
    if not model_dir:
        return ()
    path = Path(model_dir) / GENERATION_CONFIG
    if not path.is_file():
        return ()
    value = json.loads(path.read_text()).get("eos_token_id")
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    return tuple(int(v) for v in values)


def template_turn_end(tokenizer: Any, what: str) -> int | None:
    """The special token the tokenizer's chat template closes an assistant turn with, or None when the template
    puts no special token after the message (only the EOS can end such a turn). `what`: the config key of the
    tokenizer, for messages. Raises TurnEndError when the template cannot render a user + assistant exchange."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        ids = list(tokenizer.apply_chat_template(PROBE_CONVERSATION, tokenize=True, return_dict=False))
    except Exception as err:  # a template's own raise_exception, or a jinja error: the message names it
        raise TurnEndError(f"{what}: the chat template cannot render a user + assistant exchange: {err}") from err
    after = _content_end(tokenizer, ids)
    if after is None:
        raise TurnEndError(f"{what}: the chat template's rendering does not hold the assistant's content as text")
    special = set(tokenizer.all_special_ids) | _special_added_ids(tokenizer)
    return next((token for token in ids[after:] if token in special), None)


def _content_end(tokenizer: Any, ids: list[int]) -> int | None:
    """The first position after which the decoded prefix holds the assistant's whole content."""
    for position in range(1, len(ids) + 1):
        if PROBE_CONTENT in tokenizer.decode(ids[:position], skip_special_tokens=False):
            return position
    return None


def _special_added_ids(tokenizer: Any) -> set[int]:
    """Added tokens marked special (Llama 3's <|eot_id|> is one without being in all_special_ids)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {int(i) for i, token in decoder.items() if getattr(token, "special", False)}


def stop_set_of(tokenizer: Any, model_dir: str | Path | None, *, chat_template: bool, what: str) -> StopSet:
    """The stop set of a model: its tokenizer's EOS, `model_dir`'s generation_config.json eos ids and, where the run
    renders prompts with the chat template (`chat_template`), the template's turn end."""
    eos = tokenizer.eos_token_id
    turn_end = template_turn_end(tokenizer, what) if chat_template else None
    stop = StopSet(None if eos is None else int(eos), config_eos_ids(model_dir), turn_end)
    names = tuple((token, str(tokenizer.convert_ids_to_tokens(token))) for token in stop.ids)
    return StopSet(stop.eos, stop.config_eos, stop.turn_end, names)


def student_stop_set(cfg: GKDConfig, tokenizer: Any) -> StopSet:
    """The student's stop set (every rollout engine's): the chat template's turn end where prompts are rendered
    with it (data.apply_chat_template, or the conversations of rollout.env)."""
    key = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.student_path"
    uses_template = cfg.data.apply_chat_template or bool(cfg.rollout.env)
    return stop_set_of(tokenizer, cfg.model.student_path, chat_template=uses_template, what=key)


def check_turn_ends(cfg: GKDConfig, student: StopSet) -> None:
    """Every teacher of the student's tokenizer closes an assistant turn where the student does (the fingerprint
    compares vocabularies, not templates: a Base student beside an Instruct teacher passes it). Raises ConfigError
    naming both keys. Teachers of another tokenizer map their own end (algorithm.cross_tokenizer); a teacher whose
    files are not on this node (a remote server's path) is checked by `python -m recipe_gkd.doctor` there."""
    from transformers import AutoTokenizer

    from recipe_gkd.config import CrossTokenizer
    from recipe_gkd.config.teachers import teacher_handles

    if cfg.algorithm.cross_tokenizer != CrossTokenizer.none:
        return
    uses_template = cfg.data.apply_chat_template or bool(cfg.rollout.env)
    student_key = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.student_path"
    for handle in teacher_handles(cfg).values():
        section = handle.section
        if not section.model_path or not Path(section.model_path).is_dir():
            continue
        tokenizer = AutoTokenizer.from_pretrained(section.model_path)
        if section.chat_template:
            tokenizer.chat_template = Path(section.chat_template).read_text()
        teacher = stop_set_of(tokenizer, section.model_path, chat_template=uses_template, what=handle.key("model_path"))
        if teacher.closing_id != student.closing_id:
            raise ConfigError(
                handle.key("model_path"),
                f"{handle.who} closes an assistant turn with {_closing(teacher)} and the student ({student_key}) with "
                f"{_closing(student)}, on the same vocabulary: the teacher would score the student's turn end as "
                "text. Give both the same chat template (teacher.chat_template, or the student's tokenizer_config's "
                "chat_template) or use the teacher's tokenizer for the student (model.tokenizer_path)",
            )


def _closing(stop: StopSet) -> str:
    token = stop.closing_id
    if token is None:
        return "no token"
    source = "its chat template's turn end" if token == stop.turn_end else "its EOS (no turn end in its template)"
    return f"{stop.name(token)!r} ({token}, {source})"
