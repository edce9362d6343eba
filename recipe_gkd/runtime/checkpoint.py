"""Crash-consistent checkpoints: save, verify, pick the one to resume from, keep the newest N.

    <run_dir>/checkpoints/step_000012/
        actor/               megatron dist checkpoint (model + optimizer, resharded on load) + lr schedule
        trainer_state.json   step, weight version, each rollout worker's data position, config hash
        COMPLETE             written last: size and sha256 of every other file

A checkpoint is written into `.tmp_step_000012` and renamed into place once COMPLETE is on
disk, so a crash at any moment leaves either no `step_*` directory or a complete one. A
`step_*` directory that fails verification (missing marker, size or checksum mismatch:
truncated or corrupted later) is skipped on resume with a log line naming it.

Resume rule for the async schedules: a checkpoint records the data position after the last
*trained* batch; batches generated but not yet trained are regenerated on resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from recipe_gkd.config import ConfigError, GKDConfig
from recipe_gkd.config.teachers import teacher_handles
from recipe_gkd.pools import Pools

CHECKPOINTS_DIR = "checkpoints"
ACTOR_DIR = "actor"
TRAINER_STATE_FILE = "trainer_state.json"
COMPLETE_FILE = "COMPLETE"
STEP_PATTERN = re.compile(r"^step_(\d{6,})$")
TMP_PREFIX = ".tmp_"
HASH_CHUNK = 1 << 20
FORMAT_VERSION = 1

# Config keys whose change alters what is trained or how: a resumed run must match them.
# Everything else (total_steps, loggers, timeouts, placement, tensor-parallel size, eval) may change.
SEMANTIC_KEYS = (
    "model.student_path",
    "model.tokenizer_path",
    "data.train_files",
    "data.prompt_key",
    "data.response_key",
    "data.apply_chat_template",
    "data.train_batch_size",
    "data.max_prompt_length",
    "data.seed",
    "algorithm",
    "actor.precision",
    "actor.optim",
    "rollout.backend",
    "rollout.sampling",
    "teacher.model_path",
    "teacher.top_k",
    "teacher.temperature",
)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (named by path) or does not fit the config."""


@dataclass
class TrainerState:
    """What the driver needs besides the actor's own state to continue a run exactly."""

    step: int  # optimizer steps done = batches trained (batch indices 0..step-1)
    weight_version: int
    # Per rollout worker: prompts of its shard consumed by the trained batches.
    data_positions: list[int]
    config_hash: str
    semantic_config: dict[str, Any]
    # Sampling and the on/off-policy coin flips are seeded by (data.seed, stream position), so no
    # process-global RNG state is needed to reproduce a step; the actor's RNG states are in actor/.
    rng: dict[str, Any] = field(default_factory=dict)
    saved_at: float = 0.0
    format_version: int = FORMAT_VERSION


# ----------------------------------------------------------------------------- config identity


def semantic_config(cfg: GKDConfig) -> dict[str, Any]:
    """The SEMANTIC_KEYS of `cfg`, flattened to dotted keys (JSON values)."""
    tree = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)
    flat: dict[str, Any] = {}
    for key in SEMANTIC_KEYS:
        node: Any = tree
        for part in key.split("."):
            node = node[part]
        _flatten_into(flat, key, node)
    # A teacher's own prompt changes what it scores; keyed only when set, so that checkpoints of runs without one
    # keep their hash.
    for handle in teacher_handles(cfg).values():
        if handle.prompt.privileged:
            flat[handle.prompt.key] = handle.prompt.describe()
    return flat


def _flatten_into(out: dict[str, Any], prefix: str, node: Any) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            _flatten_into(out, f"{prefix}.{k}", v)
    else:
        out[prefix] = node


def config_hash(semantic: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(semantic, sort_keys=True).encode()).hexdigest()[:16]


def check_config(state: TrainerState, cfg: GKDConfig, path: Path) -> None:
    """Refuse to resume a run whose training semantics changed; names every differing key."""
    now = semantic_config(cfg)
    if config_hash(now) == state.config_hash:
        return
    keys = sorted(set(now) | set(state.semantic_config))
    diffs = [
        f"{k}: {state.semantic_config.get(k)!r} -> {now.get(k)!r}"
        for k in keys
        if now.get(k) != state.semantic_config.get(k)
    ]
    raise ConfigError(
        "trainer.resume",
        f"checkpoint {path} was saved with a different training setup ({'; '.join(diffs)}); restore those keys, "
        "or set trainer.resume=none (or another trainer.run_dir) to start fresh",
    )


# ----------------------------------------------------------------------------- writing


def checkpoints_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def step_dir(run_dir: str | Path, step: int) -> Path:
    return checkpoints_root(run_dir) / f"step_{step:06d}"


def staging_dir(run_dir: str | Path, step: int) -> Path:
    """An empty temporary directory for the checkpoint of `step` (a leftover of a crash is removed)."""
    tmp = checkpoints_root(run_dir) / f"{TMP_PREFIX}step_{step:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(tmp: Path, state: TrainerState) -> Path:
    """Write the trainer state and the COMPLETE marker into `tmp`, then rename it into place."""
    (tmp / TRAINER_STATE_FILE).write_text(json.dumps(asdict(state), indent=1) + "\n")
    files = {str(p.relative_to(tmp)): _file_entry(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    marker = tmp / COMPLETE_FILE
    marker.write_text(json.dumps({"step": state.step, "files": files}, indent=1) + "\n")
    for path in [*tmp.rglob("*"), tmp]:
        if path.is_file():
            _fsync(path)
    final = tmp.parent / tmp.name.removeprefix(TMP_PREFIX)
    if final.exists():  # a checkpoint of the same step from an earlier attempt: replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    return final


def _file_entry(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync(path)
    except OSError:
        return  # some filesystems refuse fsync on directories: the rename is still atomic


def prune(run_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints (and any staging leftovers); returns the deleted."""
    root = checkpoints_root(run_dir)
    deleted = []
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old)
        deleted.append(old)
    for tmp in root.glob(f"{TMP_PREFIX}*") if root.is_dir() else []:
        shutil.rmtree(tmp)
        deleted.append(tmp)
    return deleted


# ----------------------------------------------------------------------------- reading


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """`step_*` directories under <run_dir>/checkpoints, oldest first (complete or not)."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_PATTERN.match(p.name)]
    return sorted(found, key=lambda p: int(STEP_PATTERN.match(p.name).group(1)))  # type: ignore[union-attr]


def verify(path: Path) -> str | None:
    """Why `path` is not a usable checkpoint (missing marker, size or checksum mismatch), or None."""
    marker = path / COMPLETE_FILE
    if not marker.is_file():
        return f"no {COMPLETE_FILE} marker (an interrupted save)"
    try:
        manifest = json.loads(marker.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        return f"unreadable {COMPLETE_FILE} marker ({err})"
    for name, entry in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != entry["size"]:
            return f"{name} has {size} bytes, {entry['size']} were written (truncated?)"
        if _sha256(file) != entry["sha256"]:
            return f"{name} fails its sha256 checksum (corrupted)"
    if TRAINER_STATE_FILE not in files:
        return f"{TRAINER_STATE_FILE} is missing"
    return None


def read_state(path: Path) -> TrainerState:
    data = json.loads((path / TRAINER_STATE_FILE).read_text())
    return TrainerState(**data)


def find_resume(cfg: GKDConfig, log: Any = print) -> Path | None:
    """The checkpoint trainer.resume asks for: auto = newest complete one, none = None, else that path.

    Checkpoints that fail `verify` are skipped under auto (each named in a log line); an
    explicit path that fails is an error.
    """
    resume = cfg.trainer.resume
    if resume == "none":
        return None
    if resume != "auto":
        path = Path(resume)
        problem = verify(path)
        if problem:
            raise CheckpointError(f"trainer.resume={resume}: not a usable checkpoint: {problem}")
        return path
    for path in reversed(list_checkpoints(cfg.trainer.run_dir)):
        problem = verify(path)
        if problem is None:
            return path
        log(f"checkpoint {path} skipped: {problem}; trying an older one")
    return None


def set_aside_old_checkpoints(run_dir: str | Path) -> Path | None:
    """trainer.resume=none in a run directory with checkpoints: move them aside (never deleted)."""
    root = checkpoints_root(run_dir)
    if not root.is_dir() or not any(root.iterdir()):
        return None
    aside = root.with_name(f"{CHECKPOINTS_DIR}.before_{time.strftime('%Y%m%d_%H%M%S')}")
    root.rename(aside)
    return aside


def redistribute_positions(positions: list[int], workers: int, path: Path) -> list[int]:
    """Each rollout worker's position for `workers` workers (the stream is contiguous per step)."""
    if len(positions) == workers:
        return list(positions)
    consumed = sum(positions)
    if consumed % workers or len(set(positions)) != 1:
        raise CheckpointError(
            f"checkpoint {path} was saved with {len(positions)} rollout workers at positions {positions}; "
            f"{consumed} prompts do not split over {workers} workers: resume with the old rollout worker count"
        )
    return [consumed // workers] * workers


# ----------------------------------------------------------------------------- metrics files


def truncate_rows(path: Path, last_step: int) -> int:
    """Drop the rows of a jsonl metrics file with step > last_step (written after the checkpoint).

    Also drops a final partial line (a crash mid-write). Returns the number of rows dropped.
    """
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if int(row.get("step", 0)) <= last_step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return dropped


# ----------------------------------------------------------------------------- the driver's side


def prepare_resume(cfg: GKDConfig, log: Any = print) -> Path | None:
    """Pick the checkpoint to resume from, check it fits the config, cut the metrics files back to it.

    Runs before any process starts, so a config mismatch exits at once (ConfigError, exit 2).
    Rows of metrics.jsonl / eval.jsonl / samples.jsonl written after the checkpoint (a crash lost their steps)
    are dropped, so the files show every step once. A fresh start (no checkpoint) empties them.
    """
    from recipe_gkd.observe.metrics import EVAL_FILE, METRICS_FILE
    from recipe_gkd.rollout.samples import SAMPLES_FILE

    run_dir = Path(cfg.trainer.run_dir)
    path = find_resume(cfg, log)
    last_step = -1
    if path is None and cfg.trainer.resume == "none":
        aside = set_aside_old_checkpoints(run_dir)
        if aside:
            log(f"trainer.resume=none: the earlier checkpoints of {run_dir} were moved to {aside}")
    if path is not None:
        state = read_state(path)
        check_config(state, cfg, path)
        last_step = state.step
        log(f"resuming from checkpoint {path} (step {state.step}, weight version {state.weight_version})")
    for name in (METRICS_FILE, EVAL_FILE, SAMPLES_FILE):
        dropped = truncate_rows(run_dir / name, last_step)
        if dropped:
            log(f"{run_dir / name}: dropped {dropped} rows after step {max(last_step, 0)} (re-done by this run)")
    return path


def save(cfg: GKDConfig, pools: Pools, step: int, version: int) -> Path:
    """Checkpoint after `step` trained batches: actor state, data positions; atomic; keep trainer.keep_last."""
    start = time.perf_counter()
    tmp = staging_dir(cfg.trainer.run_dir, step)
    pools.actor.save_checkpoint(str(tmp / ACTOR_DIR))
    # The position after the last *trained* batch: read-ahead batches are regenerated on resume.
    positions = pools.rollout.data_positions(step - 1)
    semantic = semantic_config(cfg)
    state = TrainerState(step, version, positions, config_hash(semantic), semantic, saved_at=time.time())
    path = commit(tmp, state)
    prune(cfg.trainer.run_dir, cfg.trainer.keep_last)
    print(f"checkpoint {path} saved in {time.perf_counter() - start:.1f}s", flush=True)
    return path


def restore(cfg: GKDConfig, pools: Pools, path: Path) -> tuple[int, int]:
    """Load `path` into every actor rank, set the rollout workers' data positions, sync the weights.

    Returns (trained steps, weight version) to continue from.
    """
    start = time.perf_counter()
    state = read_state(path)
    pools.actor.load_checkpoint(str(path / ACTOR_DIR))
    pools.rollout.set_positions(redistribute_positions(state.data_positions, pools.rollout.size, path))
    # The rollout engines hold the initial student: give them the checkpoint's weights and version.
    pools.weights.push(state.weight_version)
    print(f"restored step {state.step} from {path} in {time.perf_counter() - start:.1f}s", flush=True)
    return state.step, state.weight_version
