"""Chat message lists as records hold them (`[{"role": ..., "content": ...}, ...]`): checked once, where they are read."""

from __future__ import annotations

from typing import Any

from teacher_server.config.errors import ConfigError


def checked_messages(messages: list[Any], key: str, field_name: str) -> list[dict[str, str]]:
    """A chat dataset's message list (record field `field_name`), each a {"role", "content"} mapping;
    ConfigError naming `key` otherwise."""
    checked = []
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str) and "content" in message):
            raise ConfigError(
                key, f"{field_name!r} message {i} is not a {{'role': ..., 'content': ...}} mapping: {message!r:.200}"
            )
        checked.append({"role": message["role"], "content": str(message["content"])})
    return checked


def prompt_messages(messages: list[Any], field_name: str, key: str = "data.prompt_key") -> list[dict[str, str]]:
    """The messages that prompt the model (record field `field_name`, read for config key `key`): all of them
    without the trailing assistant turns."""
    checked = checked_messages(messages, key, field_name)
    while checked and checked[-1]["role"] == "assistant":
        checked.pop()
    if not checked:
        raise ConfigError(key, f"{field_name!r} holds no message before the assistant's")
    return checked
