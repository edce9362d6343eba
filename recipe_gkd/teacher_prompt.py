"""A teacher's own prompt per record (privileged context, on-policy self-distillation; docs/privileged_teacher.md).

By default a teacher scores the student's response after the student's own prompt. With a teacher prompt rule
(`data.teacher_prompt_key` / `data.teacher_prompt_template`, or a teacher's own `prompt_key` / `prompt_template`
under `teachers:`) the teacher sees more: the record's reference solution, a hint, a longer system prompt. The
rollout worker renders that prompt with the teacher's chat template and generation prompt (teacher.model_path's
tokenizer) and appends the student's sampled response ids unchanged, with `score_from` at the join, so row i of the
reply is the teacher's distribution for the student's response token i. The student never sees it: its rollout and
its held-out evaluation encode `data.prompt_key` only.

One class per rule, chosen once per teacher (`prompt_rule`):
- `StudentPrompt`: the student's prompt ids (no privileged context);
- `FieldPrompt`: a record field, a string (one user turn) or a chat message list;
- `TemplatePrompt`: `{prompt}` and named record fields formatted into one user turn (with a message-list prompt,
  `{prompt}` is its last user turn's content, and the formatted text replaces it; a system turn stays).

A teacher prompt longer than its bound (`data.max_teacher_prompt_length`, 0: data.max_prompt_length) is refused
with an error naming that key, never cut: cutting from the left drops the system prompt and the chat template's
opening, cutting from the right drops the end of the context and the generation prompt, and either changes what the
teacher is asked without saying so. The student's response is never cut.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from typing import Any, ClassVar

from recipe_gkd.messages import checked_messages, prompt_messages
from teacher_server.config.errors import ConfigError

# What a prompt value is: a plain string (one user turn) or a chat message list.
PromptValue = str | list[dict[str, str]]


class TeacherPrompt:
    """The student's own prompt: the teacher scores what the student saw (no privileged context)."""

    # Whether the teacher sees a prompt of its own (rendered with its tokenizer, joined to the response ids).
    privileged: ClassVar[bool] = False

    def __init__(self, key: str, prompt_key: str, chat_template: bool) -> None:
        self.key = key  # the config key that chose the rule, for errors
        self.prompt_key = prompt_key  # data.prompt_key
        self.chat_template = chat_template  # data.apply_chat_template

    def __eq__(self, other: object) -> bool:
        # Value equality: rules built from the same config are the same rule (TeacherHandle, a frozen dataclass
        # that holds one, compares by its fields).
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted((k, repr(v)) for k, v in vars(self).items()))))

    def record_fields(self) -> dict[str, str]:
        """Record field -> the config key that reads it (what check_record_fields asks of every data file)."""
        return {}

    def value(self, record: dict[str, Any], where: str) -> PromptValue:
        """The teacher's prompt of `record` (`where`: the record, for the error), as a string or messages (the
        conversation up to its last non-assistant turn, as the student's prompt is read)."""
        value = self._field(record, self.prompt_key, where)
        return prompt_messages(value, self.prompt_key) if isinstance(value, list) else str(value)

    def describe(self) -> str:
        return "the student's prompt"

    def teacher_record(self, record: dict[str, Any], where: str) -> dict[str, Any]:
        """`record` with the teacher's prompt as its prompt (data.prompt_key), for a teacher that renders the prompt
        itself in its own tokens (algorithm.cross_tokenizer): the record itself here."""
        return record

    def join(
        self,
        teacher_tokenizer: Callable[[], tuple[Any, str | None]],
        record: dict[str, Any] | None,
        sequence: Any,
        score_from: int,
        where: str,
        bound: int,
    ) -> tuple[Any, int]:
        """The ids the teacher scores and where its scores start, for the student's `sequence` (its prompt + response
        ids, the response from `score_from`): the student's own here (no privileged context).

        `teacher_tokenizer()`: the teacher's tokenizer and chat template text (read on first call)."""
        return sequence, score_from

    def _field(self, record: dict[str, Any], field: str, where: str) -> Any:
        if field not in record or record[field] is None:
            raise ConfigError(
                self.key,
                f"{where} has no field {field!r} (fields: {sorted(record)}): every record needs the teacher's "
                "prompt; fix the data or the key",
            )
        return record[field]


class StudentPrompt(TeacherPrompt):
    """No teacher prompt configured: the student's prompt ids are the teacher's."""


class PrivilegedPrompt(TeacherPrompt):
    """A prompt of the teacher's own: rendered with the teacher's tokenizer, joined to the student's response ids."""

    privileged: ClassVar[bool] = True

    def join(
        self,
        teacher_tokenizer: Callable[[], tuple[Any, str | None]],
        record: dict[str, Any] | None,
        sequence: Any,
        score_from: int,
        where: str,
        bound: int,
    ) -> tuple[Any, int]:
        """The teacher's prompt of `record` rendered with the teacher's tokenizer (its chat template, or
        teacher.chat_template) and the generation prompt, then the student's response ids `sequence[score_from:]`
        exactly; the new score_from is the join. A teacher prompt over `bound` tokens is refused (module doc)."""
        import numpy as np

        if record is None:
            raise ValueError(f"{self.key}: the teacher's prompt is read from the record, and none was given ({where})")
        tokenizer, template = teacher_tokenizer()
        prompt_ids = encode_value(tokenizer, self.value(record, where), self.chat_template, template, self.key)
        if len(prompt_ids) > bound:
            # A ConfigError: the run stops with exit 2 naming the key, from a rollout worker too (exit_codes.exit_code_for).
            raise ConfigError(
                "data.max_teacher_prompt_length",
                f"{where}: the teacher's prompt ({self.describe()}) has {len(prompt_ids)} tokens > {bound}; raise "
                "data.max_teacher_prompt_length or shorten the record's privileged context (a teacher prompt is never "
                "cut)",
            )
        response_ids = np.asarray(sequence[score_from:], dtype=np.int32)
        return np.concatenate([np.asarray(prompt_ids, dtype=np.int32), response_ids]), len(prompt_ids)

    def teacher_record(self, record: dict[str, Any], where: str) -> dict[str, Any]:
        return {**record, self.prompt_key: self.value(record, where)}


class FieldPrompt(PrivilegedPrompt):
    """A record field holding the teacher's prompt: a string (one user turn) or a chat message list."""

    def __init__(self, key: str, prompt_key: str, chat_template: bool, field: str) -> None:
        super().__init__(key, prompt_key, chat_template)
        self.field = field

    def record_fields(self) -> dict[str, str]:
        return {self.field: self.key}

    def value(self, record: dict[str, Any], where: str) -> PromptValue:
        value = self._field(record, self.field, where)
        return prompt_messages(value, self.field, self.key) if isinstance(value, list) else str(value)

    def describe(self) -> str:
        return f"record field {self.field!r}"


class TemplatePrompt(PrivilegedPrompt):
    """`{prompt}` and named record fields formatted into the teacher's user turn."""

    def __init__(self, key: str, prompt_key: str, chat_template: bool, template: str) -> None:
        super().__init__(key, prompt_key, chat_template)
        self.template = template
        self.fields = template_fields(template, key)

    def record_fields(self) -> dict[str, str]:
        return {f: self.key for f in self.fields if f != "prompt"}

    def value(self, record: dict[str, Any], where: str) -> PromptValue:
        prompt = record.get(self.prompt_key)
        if prompt is None:
            raise ConfigError("data.prompt_key", f"{where} has no field {self.prompt_key!r} (fields: {sorted(record)})")
        named = {f: str(self._field(record, f, where)) for f in self.fields if f != "prompt"}
        if not isinstance(prompt, list):
            return self.template.format(prompt=str(prompt), **named)
        messages = checked_messages(prompt, "data.prompt_key", self.prompt_key)
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        if last_user is None:
            raise ConfigError(self.key, f"{where}: {self.prompt_key!r} holds no user turn to format {{prompt}} from")
        text = self.template.format(prompt=messages[last_user]["content"], **named)
        return [*messages[:last_user], {"role": "user", "content": text}, *messages[last_user + 1 :]]

    def describe(self) -> str:
        return f"template {self.template!r}"


def template_fields(template: str, key: str) -> list[str]:
    """The record fields a template names (`{prompt}` is data.prompt_key's); ConfigError naming `key` on a bad one."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:
        raise ConfigError(
            key, f"is not a format string ({err}): write record fields as {{name}}, braces as {{{{ }}}}"
        ) from None
    fields = []
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            raise ConfigError(
                key, f"{{{name}}}: name a record field plainly ({{prompt}}, {{solution}}), no index or format"
            )
        fields.append(name)
    if not fields:
        raise ConfigError(
            key, "names no field: write {prompt} and the privileged fields, e.g. {prompt}\\n\\nHint: {hint}"
        )
    return list(dict.fromkeys(fields))


def prompt_rule(data: Any, section: Any, key_prefix: str) -> TeacherPrompt:
    """A teacher's prompt rule: its own `prompt_key` / `prompt_template` (section), else data's, else the student's."""
    common = (data.prompt_key, data.apply_chat_template)
    if section.prompt_key:
        return FieldPrompt(f"{key_prefix}.prompt_key", *common, section.prompt_key)
    if section.prompt_template:
        return TemplatePrompt(f"{key_prefix}.prompt_template", *common, section.prompt_template)
    if data.teacher_prompt_key:
        return FieldPrompt("data.teacher_prompt_key", *common, data.teacher_prompt_key)
    if data.teacher_prompt_template:
        return TemplatePrompt("data.teacher_prompt_template", *common, data.teacher_prompt_template)
    return StudentPrompt("data.prompt_key", *common)


def teacher_prompt_bound(data: Any) -> int:
    """The longest teacher prompt in tokens (data.max_teacher_prompt_length, 0: data.max_prompt_length)."""
    return int(data.max_teacher_prompt_length or data.max_prompt_length)


def encode_value(tokenizer: Any, value: PromptValue, chat_template: bool, template: str | None, key: str) -> list[int]:
    """Token ids of a prompt value through `tokenizer`'s chat template (or `template`) with the generation prompt,
    as the student's prompt is encoded (recipe_gkd/data.py encode_prompt); plain text with data.apply_chat_template
    false."""
    if isinstance(value, list) or chat_template:
        messages = value if isinstance(value, list) else [{"role": "user", "content": value}]
        if not chat_template:
            raise ConfigError("data.apply_chat_template", f"{key} gives messages: they need the chat template")
        return list(
            tokenizer.apply_chat_template(
                messages, chat_template=template, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    return list(tokenizer(value, add_special_tokens=True)["input_ids"])


def own_prompt_encoder(handle: Any, data: Any) -> Callable[[Any, dict[str, Any]], list[int]]:
    """`encode(tokenizer, record)`: the teacher's own prompt ids of a record (its rule's value through its chat
    template, or teacher.chat_template), for its held-out accuracy with its privileged context."""
    from pathlib import Path

    section = handle.section
    template = Path(section.chat_template).read_text() if section.chat_template else None

    def encode(tokenizer: Any, record: dict[str, Any]) -> list[int]:
        value = handle.prompt.value(record, "a held-out record")
        return encode_value(tokenizer, value, data.apply_chat_template, template, handle.prompt.key)

    return encode
