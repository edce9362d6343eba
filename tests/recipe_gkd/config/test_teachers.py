"""Several teachers in one run (issue 37): the `teachers:` map and its rules, each record's teacher,
the GPU split among teachers, and the rollout worker's TeacherSet (routing, concurrency, order, errors)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from recipe_gkd.batch import RolloutStats
from recipe_gkd.config import CONFIG_DIR, ConfigError, load_config, to_yaml
from recipe_gkd.config.teachers import record_teacher, teacher_handles, teacher_sections
from recipe_gkd.data import check_record_teachers
from recipe_gkd.observe.metrics import teacher_columns
from recipe_gkd.plan.placement import build_plan, format_plan
from recipe_gkd.rollout.teacher_set import TeacherSet
from recipe_gkd.targets import build_target
from teacher_server.client.zmq_client import TeacherDeadError
from teacher_server.wire.protocol import TeacherScores

TWO = CONFIG_DIR / "presets" / "cpu_two_teachers.yaml"
DEMO = CONFIG_DIR / "presets" / "cpu_demo.yaml"
ONE_BY_EIGHT = CONFIG_DIR / "presets" / "1x8_a1_r3_t4.yaml"


def _error(path: Path, overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value


def test_only_teacher_is_the_teacher_named_default() -> None:
    cfg = load_config(DEMO)
    assert cfg.teachers == {} and teacher_sections(cfg) == {"default": cfg.teacher}
    assert record_teacher(cfg, {"prompt": "x"}, "record 0") == "default"
    # Without teachers: the field is not read: a dataset that happens to have it trains as before.
    assert record_teacher(cfg, {"prompt": "x", "teacher": "Ms. Lee"}, "record 0") == "default"


def test_teachers_fill_teacher_from_the_first_and_round_trip(tmp_path: Path) -> None:
    cfg = load_config(TWO)
    assert list(cfg.teachers) == ["reverse", "sum"]
    assert cfg.teacher == cfg.teachers["reverse"]
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg  # a resolved config (teacher: = the first teacher) reloads


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["teacher.top_k=4"], "teacher"),  # teacher: beside teachers:
        (["teachers.sum.top_k=4"], "teachers.sum.top_k"),  # the student trains on one top-k size
        (["teachers.sum.top_k=128"], "teachers.sum.top_k"),  # a section's own rule (top_k <= max_top_k), renamed
        (["teachers.sum.replicas=2"], "teachers"),  # the teachers' GPUs no longer add up to the leftover
        (["data.default_teacher=code"], "data.default_teacher"),
        (["data.teacher_key="], "data.teacher_key"),
        (["teachers.sum.max_model_len=8"], "teachers.sum.max_model_len"),
        (
            ["teachers.sum.address=tcp://127.0.0.1:7000", "teachers.reverse.address=tcp://127.0.0.1:7000"],
            "teachers.sum.address",
        ),
    ],
)
def test_each_teachers_rule_names_its_key(overrides: list[str], key: str) -> None:
    assert _error(TWO, overrides).key == key


def test_default_teacher_takes_records_without_the_field() -> None:
    cfg = load_config(TWO, ["data.default_teacher=sum"])
    assert record_teacher(cfg, {"prompt": "x"}, "r") == "sum"
    assert record_teacher(cfg, {"teacher": "reverse"}, "r") == "reverse"
    assert record_teacher(load_config(TWO), {"prompt": "x"}, "r") == "reverse"  # empty: the first teacher


def test_an_unknown_teacher_in_a_data_file_stops_before_training(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": "p", "teacher": t}) + "\n" for t in ["reverse", "sum", None, "code"]))
    cfg = load_config(TWO, [f"data.train_files=[{data}]", "data.eval_files=[]", "trainer.eval_every=0"])
    with pytest.raises(ConfigError) as info:
        check_record_teachers(cfg)
    err = info.value
    assert err.key == "data.teacher_key"
    assert "'code'" in err.message and f"record 3 of {data}" in err.message
    data.write_text("".join(json.dumps({"prompt": "p", "teacher": t}) + "\n" for t in ["reverse", "sum"]))
    check_record_teachers(cfg)  # every teacher configured: passes


def test_teacher_gpus_are_split_in_config_order(tmp_path: Path) -> None:
    # 1 x 8: actor 1, rollout 3, then teacher `a` (2 replicas of 1 GPU) and teacher `b` (1 of 2 GPUs).
    from omegaconf import OmegaConf

    raw = OmegaConf.load(ONE_BY_EIGHT)
    section = raw.pop("teacher")
    raw["teachers"] = {
        "a": {**section, "replicas": 2, "gpus_per_replica": 1},
        "b": {**section, "replicas": 1, "gpus_per_replica": 2, "address": "tcp://127.0.0.1:5565"},
    }
    path = tmp_path / "two.yaml"
    OmegaConf.save(raw, path)
    plan = build_plan(load_config(path))
    assert [(s.teacher, s.rank, s.gpu_ids) for s in plan.teacher] == [("a", 0, (4,)), ("a", 1, (5,)), ("b", 0, (6, 7))]
    assert plan.teacher_gpu_ids(0, "b") == (6, 7) and plan.teacher_gpu_ids(0) == (4, 5, 6, 7)
    text = format_plan(plan)
    assert "teacher a" in text and "teacher b" in text and "teacher GPUs 4,5,6,7 (a 4,5; b 6,7)" in text


def test_single_teacher_plan_is_unchanged() -> None:
    plan = build_plan(load_config(ONE_BY_EIGHT))
    assert [(s.teacher, s.gpu_ids) for s in plan.teacher] == [("default", (4, 5)), ("default", (6, 7))]
    assert "teacher default" not in format_plan(plan)


# ----------------------------------------------------------------------------- TeacherSet


class _Fake:
    """A scorer that marks every row with its own `mark`; it sleeps `delay_s`, and with `meet` waits inside its call
    until every scorer sharing that barrier is inside its own (a sequential caller breaks the barrier)."""

    def __init__(
        self, mark: float, delay_s: float = 0.0, fail: bool = False, meet: threading.Barrier | None = None
    ) -> None:
        self.mark, self.delay_s, self.fail, self.meet = mark, delay_s, fail, meet
        self.calls: list[int] = []
        self.threads: set[str] = set()

    def score(self, sequences: list[np.ndarray], score_from: list[int]) -> list[TeacherScores]:
        self.calls.append(len(sequences))
        self.threads.add(threading.current_thread().name)
        if self.meet is not None:
            self.meet.wait(timeout=20)
        time.sleep(self.delay_s)
        if self.fail:
            raise TeacherDeadError("no teacher server answers at tcp://127.0.0.1:1")
        out = []
        for seq, start in zip(sequences, score_from, strict=True):
            n = len(seq) - start
            out.append(
                TeacherScores(
                    topk_ids=np.zeros((n, 1), np.int32),
                    topk_logprobs=np.full((n, 1), self.mark, np.float32),
                    tail_logmass=np.zeros(n, np.float32),
                    sampled_logprob=np.full(n, float(seq[0]), np.float32),
                )
            )
        return out


def test_teacher_set_routes_scores_concurrently_and_keeps_order() -> None:
    cfg = load_config(TWO)
    both = threading.Barrier(2)  # each teacher's call waits inside until the other's has started
    rev, sums = _Fake(-1.0, meet=both), _Fake(-2.0, meet=both)
    teachers = TeacherSet(cfg, build_target(cfg), {"reverse": rev, "sum": sums})
    records = [{"teacher": "sum"}, {}, {"teacher": "reverse"}, {"teacher": "sum"}]
    names = teachers.route(records, [f"record {i}" for i in range(4)])
    assert names == ["sum", "reverse", "reverse", "sum"]
    seqs = [np.array([i, 7, 8], np.int32) for i in range(4)]
    scored = teachers.score(names, seqs, [1, 1, 1, 1], [None] * 4)  # one after the other: BrokenBarrierError
    assert [float(s.topk_logprobs[0, 0]) for s in scored] == [-2.0, -1.0, -1.0, -2.0]
    assert [float(s.sampled_logprob[0]) for s in scored] == [0.0, 1.0, 2.0, 3.0]  # back in order
    assert rev.calls == [2] and sums.calls == [2]
    assert rev.threads.isdisjoint(sums.threads)
    teachers.close()


def test_teacher_set_names_the_failing_teacher() -> None:
    cfg = load_config(TWO)
    teachers = TeacherSet(cfg, build_target(cfg), {"reverse": _Fake(-1.0), "sum": _Fake(-2.0, fail=True)})
    with pytest.raises(TeacherDeadError) as info:
        teachers.score(["reverse", "sum"], [np.arange(3, dtype=np.int32)] * 2, [1, 1], [None, None])
    assert info.value.teacher == "sum" and str(info.value).startswith("teacher 'sum': no teacher server")
    with pytest.raises(ConfigError) as bad:
        teachers.route([{"teacher": "code"}], ["record 5 of hf:org/set:train"])
    assert bad.value.key == "data.teacher_key" and "record 5 of hf:org/set:train" in bad.value.message
    teachers.close()


def test_teacher_columns_are_the_handles_with_metric_columns() -> None:
    """Columns for every teacher of the run (its handles), not for the names the step's data happens to hold: a
    teacher that scored nothing this step has 0 sequences and None ratios; one teacher gives no columns."""
    stats = RolloutStats(0, 0, 3, 9, [0, 1, 2], {})
    stats.per_teacher = {
        "reverse": {"sequences": 2, "response_tokens": 6, "teacher_topk_mass_sum": 5.4, "reward_sum": 1, "rewarded": 2},
        "sum": {"sequences": 1, "response_tokens": 3, "teacher_topk_mass_sum": 3.0, "reward_sum": 0, "rewarded": 0},
    }
    handles = teacher_handles(load_config(TWO)).values()
    columns = teacher_columns([stats], handles, "eval_")
    assert columns["eval_teacher_reverse_topk_mass"] == pytest.approx(0.9)
    assert columns["eval_teacher_reverse_reward"] == 0.5 and columns["eval_teacher_sum_reward"] is None
    del stats.per_teacher["sum"]
    absent = teacher_columns([stats], handles, "")
    assert absent["teacher_sum_sequences"] == 0 and absent["teacher_sum_topk_mass"] is None
    assert absent["teacher_reverse_sequences"] == 2
    stats.per_teacher = {"default": {**stats.per_teacher["reverse"]}}
    assert teacher_columns([stats], teacher_handles(load_config(None)).values(), "") == {}


def test_start_teacher_serves_the_named_teacher_on_its_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    """launch/start_teacher.sh --teacher NAME: the plan's GPUs of that teacher; the server serves its section."""
    from recipe_gkd.plan.placement import main as placement_cli
    from teacher_server.server.settings import load_settings

    assert placement_cli(["teacher-argv", "--config", str(TWO)]) == 2, "several teachers: --teacher is required"
    assert "--teacher NAME" in capsys.readouterr().err
    assert placement_cli(["teacher-argv", "--config", str(TWO), "--teacher", "sum"]) == 0
    argv = capsys.readouterr().out.split()
    assert argv == ["--config", str(TWO), "--teacher", "sum", "--gpu-ids", "3"]
    settings = load_settings(TWO, ["server.gpu_ids=[3]"], teacher="sum")
    assert settings.teacher.model_path == "assets/paper/teacher" and [s.gpu_ids for s in settings.slots] == [("3",)]
    for name in ("", "code"):
        with pytest.raises(ConfigError) as info:
            load_settings(TWO, ["server.gpu_ids=[3]"], teacher=name)
        assert info.value.key == "--teacher"
    assert load_settings(DEMO, ["server.gpu_ids=[2]"]).teacher.model_path == "assets/demo/teacher"  # one teacher


def test_connect_checks_every_teacher_and_names_the_one_that_does_not_match(monkeypatch: pytest.MonkeyPatch) -> None:
    from recipe_gkd.rollout import teacher as teacher_module
    from teacher_server.client.zmq_client import TeacherMismatchError

    connected: list[tuple[str, str | None]] = []

    class Scorer:
        def __init__(self, cfg: object, tokenizer: object, address: str | None) -> None:
            connected.append((cfg.teacher.model_path, address))  # type: ignore[attr-defined]
            if cfg.teacher.model_path == "assets/paper/teacher":  # type: ignore[attr-defined]
                raise TeacherMismatchError("the teacher's tokenizer (hash abc) differs from the student's (def)")

        def close(self) -> None:
            closed.append(True)

    closed: list[bool] = []
    monkeypatch.setattr(teacher_module, "TeacherScorer", Scorer)
    cfg = load_config(TWO)
    with pytest.raises(TeacherMismatchError) as info:
        TeacherSet.connect(
            cfg, build_target(cfg), tokenizer=None, addresses={"reverse": "tcp://a:1", "sum": "tcp://b:2"}
        )
    assert str(info.value).startswith("teacher 'sum': the teacher's tokenizer") and info.value.teacher == "sum"
    assert connected == [("assets/demo/teacher", "tcp://a:1"), ("assets/paper/teacher", "tcp://b:2")]
    assert closed == [True], "the teacher connected before the failing one is closed"


def test_summary_table_has_a_row_pair_per_teacher() -> None:
    from recipe_gkd.observe.plots import before_after_table

    first = {"step": 0, "eval_reward": 0.1, "eval_teacher_kl": 6.0}
    first |= {"eval_teacher_reverse_reward": 0.2, "eval_teacher_reverse_kl": 0.5}
    first |= {"eval_teacher_sum_reward": 0.0, "eval_teacher_sum_kl": 11.0}
    last = {**first, "step": 150, "eval_teacher_sum_reward": 0.25, "eval_teacher_sum_kl": 2.0}
    lines = before_after_table([first, last], 0.975, "forward_kl").splitlines()
    assert [line.split()[:3] for line in lines[4:]] == [
        ["reverse:", "student", "accuracy"],
        ["reverse:", "divergence", "0.5000"],
        ["sum:", "student", "accuracy"],
        ["sum:", "divergence", "11.0000"],
    ]
    assert lines[6].split()[-2:] == ["0.0%", "25.0%"]
    single = before_after_table([{"step": 0, "eval_reward": 0.1, "eval_teacher_kl": 6.0}], None, "forward_kl")
    assert len(single.splitlines()) == 4  # one teacher: the table as before


class _FakeCross(_Fake):
    """A teacher scored in its own tokens (algorithm.cross_tokenizer): the plan calls score_records."""

    def score_records(
        self, sequences: list[np.ndarray], score_from: list[int], records: list[dict]
    ) -> list[TeacherScores]:
        return self.score(sequences, score_from)


@pytest.mark.parametrize("cross", [False, True], ids=["same_tokenizer", "cross_tokenizer"])
def test_the_emulated_teacher_latency_applies_on_every_route(cross: bool) -> None:
    """debug.teacher_latency_s (the async schedules' benchmarks): each scoring call waits it, whatever the route."""
    overrides = ["debug.teacher_latency_s=0.3", *(["algorithm.cross_tokenizer=span"] if cross else [])]
    cfg = load_config(None, overrides)
    teachers = TeacherSet(cfg, build_target(cfg), {"default": (_FakeCross if cross else _Fake)(-1.0)})
    start = time.perf_counter()
    scored = teachers.score(["default"], [np.array([1, 7, 8], np.int32)], [1], [None], [{"prompt": "x"}])
    assert time.perf_counter() - start >= 0.3 and len(scored) == 1
    teachers.close()
