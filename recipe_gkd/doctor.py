"""`python -m recipe_gkd.doctor [--config PATH] [key=value ...]`: every check a run can make before its first step.

The same arguments as `python -m recipe_gkd.main` (and `main --doctor` runs this). Each check prints one line with its
figure; the first failure exits 2 naming the key to change (docs/before_the_first_step.md):

1. the placement and the memory plan (as --dry-run), then every check a start runs (recipe_gkd/preflight.py);
2. the data: the prompts longer than data.max_prompt_length, counted with the student's tokenizer;
3. the tokenizers: a same-vocabulary teacher renders a sample record as the student does, and decodes its ids to the
   same text; both end an assistant turn where the student's stop set does;
4. each teacher (every one of `teachers:`), on its running server: it connects (its max top-k, vocabulary, tokenizer
   checked by the handshake), then scores one sequence alone, in a batch and in concurrent requests to every replica:
   the largest |logprob difference| against doctor.teacher_tolerance;
5. one smoke step on the run's real processes (generate, score, train, sync, check), each phase's seconds and each
   role's memory, in a scratch run directory: the run's own checkpoints and exported student are not touched.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from recipe_gkd.config import ConfigError, GKDConfig, load_config
from recipe_gkd.config.teachers import TeacherHandle, teacher_handles, teacher_views
from recipe_gkd.exit_codes import EXIT_BAD_CONFIG
from recipe_gkd.plan.placement import build_plan, format_plan
from recipe_gkd.preflight import START_CHECKS, Check, Finding, Status

EXIT_OK = 0
# Prompts of the smoke step (one batch of the run's shape would take a whole step of a GPU run's size).
SMOKE_PROMPTS = 4
# Sequences of other lengths the probe sequence is batched with (padding and batch shape change the kernels' sums).
BATCH_COMPANIONS = 3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m recipe_gkd.doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="yaml preset (default: configs/presets/cpu_demo.yaml)")
    parser.add_argument("overrides", nargs="*", help="key.path=value, applied after the yaml")
    return parser.parse_args(argv)


def say(finding: Finding) -> None:
    """One line per check: ok / warn / FAIL, its name, its figure (or what is wrong and the key)."""
    mark = {Status.ok: "ok  ", Status.warning: "warn", Status.error: "FAIL"}[finding.status]
    if finding.report:
        print(finding.report, flush=True)
    key = f" [{finding.key}]" if finding.key and finding.failed else ""
    print(f"{mark}  {finding.check}: {finding.line}{key}", flush=True)


# ----------------------------------------------------------------------------- data and tokenizers


def student_tokenizer(cfg: GKDConfig) -> Any:
    """The student's tokenizer, read once per doctor run (every check and teacher reads it; none changes it)."""
    return _tokenizer(cfg.model.tokenizer_path or cfg.model.student_path)


@functools.cache
def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def prompt_lengths(cfg: GKDConfig) -> str:
    """The prompts of the first doctor.data_records records of every data file, encoded as the rollout worker encodes
    them: how many exceed data.max_prompt_length (each would stop the run when its batch comes)."""
    from recipe_gkd.data import Dataset, encode_prompt

    tokenizer, d = student_tokenizer(cfg), cfg.data
    longest, over, read = 0, 0, 0
    for key, files in (("data.train_files", d.train_files), ("data.eval_files", d.eval_files)):
        if not files:
            continue
        dataset = Dataset(files, key)
        for index in range(min(len(dataset), cfg.doctor.data_records)):
            length = len(encode_prompt(tokenizer, dataset[index], d.prompt_key, d.apply_chat_template))
            longest, over, read = max(longest, length), over + (length > d.max_prompt_length), read + 1
    if over:
        raise ConfigError(
            "data.max_prompt_length",
            f"{over} of the {read} prompts read are longer than data.max_prompt_length={d.max_prompt_length} (the "
            f"longest: {longest} tokens); raise it or filter the dataset",
        )
    return f"{read} prompts read, the longest {longest} tokens (data.max_prompt_length={d.max_prompt_length})"


def same_vocabulary_teachers(cfg: GKDConfig) -> list[TeacherHandle]:
    """The teachers that score the student's own ids (not across tokenizers) and whose files are on this node."""
    if cfg.algorithm.cross_tokenizer.value != "none":
        return []
    return [h for h in teacher_handles(cfg).values() if h.section.model_path and Path(h.section.model_path).is_dir()]


def teacher_tokenizer(handle: TeacherHandle) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(handle.section.model_path)
    if handle.section.chat_template:
        tokenizer.chat_template = Path(handle.section.chat_template).read_text()
    return tokenizer


def template_agreement(cfg: GKDConfig) -> str:
    """A same-vocabulary teacher scores the student's ids as they are: its own rendering of a record must be those ids
    (a template or special-token difference the vocabulary fingerprint does not see: another default system turn, a
    BOS), and the ids must decode to the same text on both sides. A teacher with a prompt of its own renders it
    itself and is not compared."""
    from recipe_gkd.data import Dataset, encode_prompt

    d = cfg.data
    record = Dataset(d.train_files, "data.train_files")[0]
    student = student_tokenizer(cfg)
    ids = encode_prompt(student, record, d.prompt_key, d.apply_chat_template)
    compared = []
    for handle in same_vocabulary_teachers(cfg):
        if handle.prompt.privileged:
            continue
        teacher = teacher_tokenizer(handle)
        own = encode_prompt(teacher, record, d.prompt_key, d.apply_chat_template)
        if own != ids:
            at = next((i for i, (a, b) in enumerate(zip(ids, own, strict=False)) if a != b), min(len(ids), len(own)))
            raise ConfigError(
                handle.key("chat_template"),
                f"{handle.who} renders the first training record differently from the student (first difference at "
                f"token {at}: the student's {student.decode(ids[at : at + 8])!r}, the teacher's "
                f"{teacher.decode(own[at : at + 8])!r}): it would score a prompt it never renders itself. Give both "
                "one chat template (teachers' chat_template, or the student's model.tokenizer_path)",
            )
        if teacher.decode(ids) != student.decode(ids):
            raise ConfigError(
                handle.key("model_path"),
                f"the student's ids decode to other text with {handle.who}'s tokenizer: the vocabularies differ",
            )
        compared.append(handle.name)
    if not compared:
        return "no teacher scores the student's own rendering here (another tokenizer, a prompt of its own, or remote)"
    return f"{', '.join(compared)}: the first record renders to the student's {len(ids)} ids, decoded alike"


def turn_ends(cfg: GKDConfig) -> str:
    """The student's stop set, and every same-vocabulary teacher closing a turn with its closing id."""
    from recipe_gkd.stop_set import check_turn_ends, student_stop_set

    stop = student_stop_set(cfg, student_tokenizer(cfg))
    check_turn_ends(cfg, stop)
    return f"the student stops at {stop.describe()}"


STATIC_CHECKS = [
    Check("prompt lengths", prompt_lengths),
    Check("chat templates", template_agreement),
    Check("turn ends", turn_ends),
]


# ----------------------------------------------------------------------------- the teachers, live


def probe_sequences(cfg: GKDConfig) -> tuple[np.ndarray, int, list[np.ndarray], dict[str, Any]]:
    """The sequence each teacher scores (the first training prompt's ids, scored from its middle), its score_from,
    a few companions of other lengths to batch it with, and its record."""
    from recipe_gkd.data import Dataset, encode_prompt

    d = cfg.data
    dataset = Dataset(d.train_files, "data.train_files")
    tokenizer = student_tokenizer(cfg)
    records = [dataset[i] for i in range(min(len(dataset), BATCH_COMPANIONS + 1))]
    encoded = [np.asarray(encode_prompt(tokenizer, r, d.prompt_key, d.apply_chat_template), np.int32) for r in records]
    probe = encoded[0]
    companions = [np.concatenate([e, e[: 1 + i]]) for i, e in enumerate(encoded[1:] or [probe])]
    return probe, max(1, len(probe) // 2), companions, records[0]


def reply_arrays(reply: Any) -> list[np.ndarray]:
    """The float arrays of one teacher reply to compare (top-k values sorted per row: ids may swap on ties)."""
    out = []
    for name in ("topk_logprobs", "sampled_logprob", "tail_logmass", "hidden_states"):
        value = getattr(reply, name, None)
        if value is None or not np.size(value):
            continue
        array = np.asarray(value, np.float64)
        out.append(np.sort(array, axis=-1) if name == "topk_logprobs" else array)
    return out


def largest_difference(reference: Any, other: Any) -> float:
    pairs = zip(reply_arrays(reference), reply_arrays(other), strict=True)
    return max((float(np.abs(np.nan_to_num(a) - np.nan_to_num(b)).max()) for a, b in pairs), default=0.0)


def teacher_agreement(cfg: GKDConfig, name: str, view: GKDConfig, connect: Callable[[], Any], replicas: int) -> Finding:
    """Teacher `name` scores the probe sequence alone, then batched with companions, then in concurrent requests
    (max(doctor.teacher_repeats, replicas) of them, so every replica answers); the largest difference."""
    from recipe_gkd.targets import build_target

    target = build_target(view)
    probe, start, companions, record = probe_sequences(cfg)
    key = teacher_handles(cfg)[name].key("model_path")

    def score(scorer: Any, sequences: list[np.ndarray], records: list[dict[str, Any]]) -> list[Any]:
        starts = [start] + [len(s) // 2 for s in sequences[1:]]
        return target.score(scorer, sequences, starts, [None] * len(sequences), records)

    alone_scorer = connect()
    try:
        started = time.perf_counter()
        alone = score(alone_scorer, [probe], [record])[0]
        seconds = time.perf_counter() - started
        batched = score(alone_scorer, [probe, *companions], [record] * (1 + len(companions)))[0]
    finally:
        alone_scorer.close()
    repeats = max(cfg.doctor.teacher_repeats, replicas)
    scorers = [connect() for _ in range(repeats)]
    try:
        with ThreadPoolExecutor(max_workers=repeats) as pool:
            concurrent = list(pool.map(lambda s: score(s, [probe], [record])[0], scorers))
    finally:
        for scorer in scorers:
            scorer.close()
    worst = max(largest_difference(alone, r) for r in [batched, *concurrent])
    line = (
        f"teacher {name!r} ({replicas} replica(s)): one sequence alone ({seconds:.2f} s), batched with "
        f"{len(companions)} others and in {repeats} concurrent requests: largest |logprob difference| {worst:.3g} "
        f"(doctor.teacher_tolerance {cfg.doctor.teacher_tolerance:g})"
    )
    if worst > cfg.doctor.teacher_tolerance:
        return Finding(
            "teacher agreement",
            Status.error,
            line + f": the teacher disagrees with itself by as much as the distillation signal; make its scoring "
            f"batch-invariant or deterministic ({key}'s server settings), or raise doctor.teacher_tolerance",
            "doctor.teacher_tolerance",
        )
    return Finding("teacher agreement", Status.ok, line)


def teacher_checks(cfg: GKDConfig, addresses: Callable[[], dict[str, str]]) -> list[Finding]:
    """Each teacher connected (the handshake's checks: vocabulary, tokenizer, a top-k within the server's max) and held
    to its own agreement; stops at the first error, a client's refusal included."""
    from recipe_gkd.targets import build_target

    tokenizer = student_tokenizer(cfg)
    bound = addresses()
    findings: list[Finding] = []
    for name, view in teacher_views(cfg).items():
        target = build_target(view)

        def connect(v: GKDConfig = view, address: str | None = bound.get(name), kind: Any = target) -> Any:
            return kind.connect(v, tokenizer, address)

        findings += one_teacher(cfg, name, view, connect, bound.get(name))
        if findings[-1].failed:
            return findings
    return findings


def one_teacher(
    cfg: GKDConfig, name: str, view: GKDConfig, connect: Callable[[], Any], address: str | None
) -> list[Finding]:
    """Teacher `name`: connects, then agrees with itself; a refusal of its client (another vocabulary, a top_k above
    the server's max_top_k or a vLLM server's max_logprobs) is the check's error, in the client's words."""
    from teacher_server.client.zmq_client import TeacherError

    try:
        scorer = connect()
        server = getattr(getattr(scorer, "client", None), "server", None)
        scorer.close()
        replicas = int(getattr(server, "replicas", 1) or 1)
        figure = f"max top-k {server.max_top_k}, {server.backend} backend" if server is not None else "connected"
        connected = Finding("teacher connects", Status.ok, f"teacher {name!r} at {address}: {figure}")
        return [connected, teacher_agreement(cfg, name, view, connect, replicas)]
    except (TeacherError, ConfigError) as err:  # the client's own refusal, naming what to change
        return [
            Finding("teacher connects", Status.error, f"teacher {name!r} at {address}: {one_line(err)}", key_of(err))
        ]


def key_of(err: BaseException) -> str | None:
    """The key a client's refusal names, where it carries one (a ConfigError); the message names it otherwise."""
    return getattr(err, "key", None)


def one_line(err: BaseException) -> str:
    cause = getattr(err, "cause", None) or err
    return f"{type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0]}"


# ----------------------------------------------------------------------------- the smoke step


def smoke_config(cfg: GKDConfig, run_dir: Path) -> GKDConfig:
    """The run's config for one step in a scratch directory: every sync checked, memory logged, nothing saved."""
    from recipe_gkd.config import rollout_engines

    per_engine = max(1, SMOKE_PROMPTS // rollout_engines(cfg))
    tr = dataclasses.replace(
        cfg.trainer, total_steps=1, eval_every=0, save_every=0, resume="none", run_dir=str(run_dir), loggers=["jsonl"]
    )
    data = dataclasses.replace(cfg.data, train_batch_size=per_engine * rollout_engines(cfg))
    debug = dataclasses.replace(cfg.debug, log_memory=True)
    sync = dataclasses.replace(cfg.weight_sync, check_every=1)
    return dataclasses.replace(cfg, trainer=tr, data=data, debug=debug, weight_sync=sync)


def smoke_step(smoke: GKDConfig, plan: Any, addresses: Callable[[], dict[str, str]]) -> Finding:
    """One step of the run on its real pools (Ray, the engines, the actor ranks, the weight sync and its check);
    `smoke`: the run's config for it (smoke_config)."""
    from recipe_gkd import gkd
    from recipe_gkd.observe.metrics import read_metrics
    from recipe_gkd.runtime.ray_cluster import ray_cluster
    from recipe_gkd.runtime.ray_pools import launch_pools

    metrics = gkd.metrics_logger(smoke)
    try:
        with ray_cluster(smoke, plan), launch_pools(smoke, plan, addresses) as pools:
            gkd.train(smoke, pools, metrics, resume=None)
    finally:
        metrics.close()
    return smoke_finding(smoke, read_metrics(Path(smoke.trainer.run_dir))[0])


def smoke_finding(smoke: GKDConfig, row: dict[str, Any]) -> Finding:
    """The smoke step's line from its metrics row; an error where every response ran to the length limit."""
    if row.get("response_clipped_frac") == 1.0:
        return Finding(
            "smoke step",
            Status.error,
            f"every one of the {row['sequences']} responses ran to rollout.sampling.max_new_tokens="
            f"{smoke.rollout.sampling.max_new_tokens} without a stop id: the limit is too short for the task, or the "
            "student never ends its turn (a run's samples.jsonl shows what it writes)",
            "rollout.sampling.max_new_tokens",
        )
    phases = ", ".join(f"{k} {row[k]:.2f} s" for k in ("generate_s", "teacher_s", "train_s", "sync_s", "sync_check_s"))
    memory = ", ".join(f"{k.removesuffix('_mb')} {v:.0f} MiB" for k, v in row.items() if k.endswith("_mb"))
    return Finding(
        "smoke step",
        Status.ok,
        f"{row['sequences']} sequences, loss {row['loss']:.4g}, sync check {row['sync_logprob_diff']:.2g} over "
        f"{row['sync_tensors_checked']:.0f} tensors; {phases}; memory: {memory}",
    )


# ----------------------------------------------------------------------------- the command


def run_doctor(cfg: GKDConfig, plan: Any) -> int:
    """Every check in order (the module docstring); the exit code."""
    from recipe_gkd.exit_codes import error_line, exit_code_for
    from recipe_gkd.runtime.model_pins import Reader, on_this_node
    from recipe_gkd.runtime.teacher_service import teacher_service

    local = on_this_node(cfg, Reader.driver)
    for check in [*START_CHECKS, *STATIC_CHECKS]:
        finding = check.finding(local)
        say(finding)
        if finding.failed:
            return EXIT_BAD_CONFIG
    # The live part in a scratch run directory: the teachers' logs, the smoke step's metrics and export go there.
    scratch = tempfile.TemporaryDirectory(prefix="gkd-doctor-")
    smoke = smoke_config(local, Path(scratch.name) / "run")
    Path(smoke.trainer.run_dir).mkdir(parents=True)
    try:
        with scratch, teacher_service(smoke) as addresses:
            for finding in teacher_checks(smoke, addresses):
                say(finding)
                if finding.failed:
                    return EXIT_BAD_CONFIG
            finding = smoke_step(smoke, plan, addresses)
            say(finding)
            if finding.failed:
                return EXIT_BAD_CONFIG
    except Exception as err:
        code = exit_code_for(err)
        if code is None:
            raise  # not an error this tool reports itself: the traceback is the report
        print(f"FAIL  smoke step: {error_line(err).removeprefix('error: ')}", flush=True)
        return code
    print("doctor: every check passed; the run may start", flush=True)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    from recipe_gkd.runtime.model_pins import pin_models

    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        plan = build_plan(cfg)
        print(format_plan(plan), flush=True)
        pin_models(cfg)  # hub ids -> org/name@<commit>, as a run pins them
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    return run_doctor(cfg, plan)


if __name__ == "__main__":
    sys.exit(main())
