"""Config fields that declare their own bounds and choices, checked where they are declared.

Generic: the teacher section (teacher.py) and the trainer's whole schema (recipe_gkd/config/schema.py) declare
their fields with `bounded` and `one_of` and check them with `check_fields`, raising `ConfigError` (errors.py)
naming the key to change. They live here, below both, because the teacher server imports nothing of the trainer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

from teacher_server.config.errors import ConfigError


def bounded(
    default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None, note: str = ""
) -> Any:
    """A config field with its allowed range, declared where the field is; `check_fields` enforces it."""
    return field(default=default, metadata={"ge": ge, "gt": gt, "le": le, "note": note})


def one_of(default: str, choices: tuple[str, ...]) -> Any:
    """A string config field that takes one of `choices`; `check_fields` enforces it."""
    return field(default=default, metadata={"choices": choices})


def check_fields(section: Any, prefix: str) -> None:
    """Every bound and choice declared on the fields of `section` and its nested sections, in field order.

    Raises ConfigError naming the first field out of its range, e.g. `teacher.top_k: must be >= 1, got 0`.
    """
    for f in dataclasses.fields(section):
        value, key = getattr(section, f.name), f"{prefix}.{f.name}"
        if dataclasses.is_dataclass(value):
            check_fields(value, key)
            continue
        if value is None or not f.metadata:
            continue
        m = f.metadata
        if "choices" in m:
            require(value in m["choices"], key, f"must be one of {m['choices']}, got {value!r}")
            continue
        note = f" ({m['note']})" if m["note"] else ""
        low_ok = (m["ge"] is None or value >= m["ge"]) and (m["gt"] is None or value > m["gt"])
        high_ok = m["le"] is None or value <= m["le"]
        require(low_ok and high_ok, key, f"must be {_range_text(m)}{note}, got {value}")


def _range_text(m: Any) -> str:
    low = f"[{m['ge']}" if m["ge"] is not None else f"({m['gt']}" if m["gt"] is not None else ""
    if m["le"] is not None:
        return f"in {low or '(-inf'}, {m['le']}]"
    return f">= {m['ge']}" if m["ge"] is not None else f"> {m['gt']}"


def require(ok: bool, key: str, message: str) -> None:
    """Raise ConfigError(key, message) unless `ok`."""
    if not ok:
        raise ConfigError(key, message)
