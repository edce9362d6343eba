"""The one error a bad config value raises, across the project (the trainer's config and the teacher server's):
`ConfigError(key, message)`, naming the dotted key to change; the CLI exits 2 with its one line."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value is wrong; `key` is the dotted path to change."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"config error at `{key}`: {message}")
        self.key = key
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # Rebuilt from (key, message) when it crosses a process boundary (a Ray worker's error).
        return type(self), (self.key, self.message)
