"""Model references: a local directory, or a Hugging Face hub id resolved through huggingface_hub's cache.

`model.student_path`, `model.tokenizer_path` and `teacher.model_path` take either form:
`/models/qwen3-1.7b`, `Qwen/Qwen3-1.7B` or `Qwen/Qwen3-1.7B@<branch, tag or commit>`. A hub id
becomes the directory of its snapshot in the cache (HF_HOME / HF_HUB_CACHE as huggingface_hub
reads them); with HF_HUB_OFFLINE=1 only the cache is read, otherwise a missing snapshot is
downloaded. A cache is one node's: the trainer's driver pins a hub id to the commit its cache holds
(`pin_model_ref`: `Qwen/Qwen3-1.7B@<commit>`) and every process resolves that pin in its own node's cache
(`resolve_model_ref(..., cache_only=True)`), so all read the same files and none opens another node's path.
The teacher server resolves teacher.model_path the same way, on the node it runs on.
"""

from __future__ import annotations

import re
from pathlib import Path

from teacher_server.config.errors import ConfigError

# org/name (the hub's repo id grammar), optionally @revision.
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.\-]*/[\w.\-]+)(?:@(?P<revision>[\w.\-/]+))?$")
# Files a model snapshot needs: its config and its weights (tokenizer-only references need less).
MODEL_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]


def resolve_model_ref(ref: str, key: str, *, cache_only: bool = False) -> str:
    """A local directory for `ref` (returned unchanged when it is one). Raises ConfigError naming `key`.

    cache_only: read this node's cache and nothing else, even where the hub could be reached (a worker resolving
    the driver's pin: a missing snapshot is an error naming this node, never a download per process)."""
    if not ref or Path(ref).is_dir():
        return ref
    match = HUB_ID.match(ref)
    if match is None:
        raise ConfigError(key, f"{ref!r} is neither a local directory nor a hub id like Qwen/Qwen3-1.7B[@revision]")
    return str(_snapshot(match["repo"], match["revision"], key, cache_only))


def pin_model_ref(ref: str, key: str) -> str:
    """`ref` pinned to the commit of the snapshot it resolves to here (`org/name@<commit>`); a local directory or an
    empty reference is returned unchanged. Raises ConfigError naming `key` as resolve_model_ref does."""
    path = resolve_model_ref(ref, key)
    match = HUB_ID.match(ref) if path != ref else None
    if match is None:
        return ref
    return f"{match['repo']}@{Path(path).name}"  # huggingface_hub's cache: snapshots/<commit>


def download_hint(repo: str, revision: str | None) -> str:
    """How to get `repo` onto this node: the hub CLI's command (huggingface_hub >= 0.34 ships `hf`)."""
    return f"hf download {repo}" + (f" --revision {revision}" if revision else "")


def _snapshot(repo: str, revision: str | None, key: str, cache_only: bool) -> Path:
    import socket

    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = cache_only or bool(constants.HF_HUB_OFFLINE)
    where = f"{repo}@{revision}" if revision else repo
    try:
        path = snapshot_download(repo, revision=revision, allow_patterns=MODEL_PATTERNS, local_files_only=offline)
    except LocalEntryNotFoundError:
        reason = "HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else "the hub could not be reached"
        if cache_only:
            reason = "the run's processes read their own node's cache only"
        raise ConfigError(
            key,
            f"{where} is not in the Hugging Face cache of node {socket.gethostname()} ({constants.HF_HUB_CACHE}) and "
            f"{reason}: download it on that node ({download_hint(repo, revision)}), or point HF_HOME at a cache "
            "every node shares, or give a model directory",
        ) from None
    except HfHubHTTPError as err:
        raise ConfigError(key, f"{where} could not be fetched from the hub: {err}") from None
    return Path(path)
