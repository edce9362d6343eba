"""Model references: a local directory, or a Hugging Face hub id resolved through huggingface_hub's cache.

`model.student_path`, `model.tokenizer_path` and `teacher.model_path` take either form:
`/models/qwen3-1.7b`, `Qwen/Qwen3-1.7B` or `Qwen/Qwen3-1.7B@<branch, tag or commit>`. A hub id
becomes the directory of its snapshot in the cache (HF_HOME / HF_HUB_CACHE as huggingface_hub
reads them); with HF_HUB_OFFLINE=1 only the cache is read, otherwise a missing snapshot is
downloaded. The driver resolves every reference once, before anything starts, so every
process reads the same files. The teacher server resolves teacher.model_path the same way.
"""

from __future__ import annotations

import re
from pathlib import Path

from teacher_server.config import ConfigError

# org/name (the hub's repo id grammar), optionally @revision.
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.\-]*/[\w.\-]+)(?:@(?P<revision>[\w.\-/]+))?$")
# Files a model snapshot needs: its config and its weights (tokenizer-only references need less).
MODEL_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]


def resolve_model_ref(ref: str, key: str) -> str:
    """A local directory for `ref` (returned unchanged when it is one). Raises ConfigError naming `key`."""
    if not ref or Path(ref).is_dir():
        return ref
    match = HUB_ID.match(ref)
    if match is None:
        raise ConfigError(key, f"{ref!r} is neither a local directory nor a hub id like Qwen/Qwen3-1.7B[@revision]")
    return str(_snapshot(match["repo"], match["revision"], key))


def _snapshot(repo: str, revision: str | None, key: str) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = bool(constants.HF_HUB_OFFLINE)
    where = f"{repo}@{revision}" if revision else repo
    try:
        path = snapshot_download(repo, revision=revision, allow_patterns=MODEL_PATTERNS, local_files_only=offline)
    except LocalEntryNotFoundError:
        reason = "HF_HUB_OFFLINE=1" if offline else "the hub could not be reached"
        raise ConfigError(
            key,
            f"{where} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {reason}, nor a local "
            f"directory: download it first (hf download {repo}) or give a model directory",
        ) from None
    except HfHubHTTPError as err:
        raise ConfigError(key, f"{where} could not be fetched from the hub: {err}") from None
    return Path(path)
