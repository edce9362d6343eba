"""Loading a config: the schema <- a yaml preset <- `key=value` overrides, then `validate()`.

Unknown keys fail with a "did you mean" hint (KEY_ALIASES first), wrong types with the key path.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from recipe_gkd.config import teachers as teachers_config
from recipe_gkd.config.rules import validate
from recipe_gkd.config.schema import DEFAULT_CONFIG, KEY_ALIASES, GKDConfig

# The teacher section belongs to the teacher server (it serves it standalone too); ConfigError is shared.
from teacher_server.config.errors import ConfigError


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> GKDConfig:
    """Schema <- yaml at `path` (the CPU demo preset when None) <- `key=value` overrides, validated.

    Raises ConfigError naming the key for unknown keys, wrong types and rule violations.
    """
    schema = _schema()
    yaml_path = Path(path) if path is not None else DEFAULT_CONFIG
    if not yaml_path.is_file():
        raise ConfigError("--config", f"no such file {yaml_path}")
    merged = _merge(schema, OmegaConf.load(yaml_path), str(yaml_path))
    merged = _merge(merged, _parse_overrides(overrides), "command line")
    cfg: GKDConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    teachers_config.resolve_teachers(cfg)
    validate(cfg)
    return cfg


@functools.cache
def _schema() -> DictConfig:
    """The schema as OmegaConf builds it, once per process (about half of a load's time): `OmegaConf.merge` copies
    its first argument, so every load merges into a copy and this one is never changed."""
    return OmegaConf.structured(GKDConfig)


def to_dict(cfg: GKDConfig) -> dict[str, Any]:
    """The resolved config as plain dicts, lists and scalars (enums as their names): a logger's run config."""
    container = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)
    assert isinstance(container, dict)
    return {str(k): v for k, v in container.items()}


def to_yaml(cfg: GKDConfig) -> str:
    """The resolved config as yaml (saved next to every run)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _parse_overrides(overrides: Sequence[str]) -> DictConfig:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(item, "overrides are written key.path=value")
    return OmegaConf.from_dotlist(list(overrides))


def _merge(base: DictConfig, update: Any, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, update)  # type: ignore[return-value]
    except ConfigKeyError as err:
        raise _unknown_key_error(base, err, source) from None
    except (ValidationError, OmegaConfBaseException) as err:
        key = getattr(err, "full_key", None) or "?"
        raise ConfigError(str(key), f"{_first_line(err)} (from {source})") from None
    except TypeError as err:
        # OmegaConf raises a bare TypeError for a mapping given where the schema has a list (or the reverse).
        key, expected = _mismatched_container(base, update)
        raise ConfigError(key, f"expected a {expected} ({_first_line(err)}, from {source})") from None


def _mismatched_container(base: Any, update: Any, prefix: str = "") -> tuple[str, str]:
    """The first key of `update` whose value is a mapping where `base` has a list, or the reverse."""
    if not isinstance(update, DictConfig | dict) or not isinstance(base, DictConfig):
        return prefix or "?", "mapping"
    for key, value in update.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in base:
            continue
        target = base[key]
        if isinstance(target, ListConfig) and isinstance(value, DictConfig | dict):
            return path, "list"
        if isinstance(target, DictConfig) and isinstance(value, ListConfig | list):
            return path, "mapping"
        if isinstance(target, DictConfig) and isinstance(value, DictConfig | dict):
            found = _mismatched_container(target, value, path)
            if found[0] != path:
                return found
    return prefix or "?", "mapping"


def _unknown_key_error(base: DictConfig, err: ConfigKeyError, source: str) -> ConfigError:
    full_key = str(getattr(err, "full_key", "") or "")
    parent_path, _, bad = full_key.rpartition(".")
    parent = OmegaConf.select(base, parent_path) if parent_path else base
    known = list(parent.keys()) if isinstance(parent, DictConfig) else []
    hint = difflib.get_close_matches(bad, [str(k) for k in known], n=1)
    prefix = parent_path + "." if parent_path else ""
    alias = KEY_ALIASES.get(bad)
    suggestion = f"`{alias}`" if alias else f"`{prefix}{hint[0]}`" if hint else ""
    did_you_mean = f"; did you mean {suggestion}?" if suggestion else "."
    where = f"`{parent_path}`" if parent_path else "the top level"
    known_keys = ", ".join(map(str, known))
    return ConfigError(full_key, f"unknown key (from {source}){did_you_mean} Known keys in {where}: {known_keys}")


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0]
