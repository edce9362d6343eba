"""The teacher servers a single-node run starts itself (teacher.autostart) and stops: their processes, addresses and
logs, for the driver (gkd.run) and the tests."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from recipe_gkd.config import GKDConfig, cpu_threads, to_yaml
from recipe_gkd.config.teachers import DEFAULT_TEACHER, teacher_handles, teacher_sections, teacher_views
from teacher_server.config.teacher import TeacherConfig

# The driver waits for an autostarted server's READY as long as the server itself waits for its replicas
# to load (teacher.ready_timeout_s; past it the server exits naming that key, and the launcher raises with
# its log tail), plus this margin for the server's own start-up. teacher.timeout_s is a request's limit, not a
# model load's: a 70B vLLM teacher loads and captures its graphs in minutes.
AUTOSTART_MARGIN_S = 120.0


def autostart_ready_timeout_s(teacher: TeacherConfig) -> float:
    """How long the driver waits for an autostarted server of `teacher` to print READY."""
    return teacher.ready_timeout_s + AUTOSTART_MARGIN_S


def colocated_teacher_overrides(cfg: GKDConfig) -> list[str]:
    """A colocated teacher replica that dies is not restarted: the run stops, its log says why.

    A restarted vLLM replica profiles memory again beside the running actor and rollout engine
    (vllm/v1/worker/gpu_worker.py `determine_available_memory`, vllm/utils/mem_utils.py
    `memory_profiling`, 0.24.0/0.33.0): the actor's allocator releasing cache during the profile trips
    vLLM's "other processes ... release GPU memory" assertion, and anything they grew since the first
    start comes out of its KV cache. A fixed kv_cache_memory_bytes would need the first start's figure
    and still race the actor; failing loudly is the honest choice on a GPU that holds every role.
    """
    return ["server.max_restarts=0"] if cfg.cluster.colocate else []


@contextmanager
def start_local_teacher(cfg: GKDConfig, name: str = DEFAULT_TEACHER) -> Iterator[Callable[[], str]]:
    """A local server process for the run's teacher `name` (its autostart), started now; yields the call
    that waits for it to be READY and returns its bound address.

    The run starts Ray and its actor workers while the server loads. The server reads the run's
    resolved config, so it serves exactly what the trainer expects; its log goes to
    <run_dir>/teacher_server.log (several teachers: one resolved config and log per teacher, named after it).
    """
    from recipe_gkd.plan.placement import build_plan, gpu_list
    from teacher_server.client.launcher import start_teacher

    run_dir = Path(cfg.trainer.run_dir)
    view, handle = teacher_views(cfg)[name], teacher_handles(cfg)[name]
    resolved = run_dir / f"resolved_config{handle.file_suffix}.yaml"
    # A teacher's own view (its `teacher:` is its section) is written here; the run's own config by main.py.
    if view is not cfg or not resolved.is_file():
        resolved.write_text(to_yaml(view))
    # The server reads the teacher section only: its GPUs are what this run's plan leaves to this teacher,
    # through a preset CUDA_VISIBLE_DEVICES as Ray maps the actor's and rollout's.
    gpu_ids = gpu_list(build_plan(cfg).teacher_gpu_ids(0, name))
    threads = cpu_threads(cfg)["teacher"]
    logs = run_dir.resolve() / handle.replica_logs
    with start_teacher(
        resolved,
        ([f"server.torch_threads={threads}"] if threads else []) + colocated_teacher_overrides(cfg),
        # Replica logs stay with the run.
        extra_args=["--log-dir", str(logs), *(["--gpu-ids", gpu_ids] if gpu_ids else [])],
        log_path=run_dir / handle.log_name,
        ready_timeout_s=autostart_ready_timeout_s(view.teacher),
    ) as server:
        yield lambda: server.ready().address


@contextmanager
def autostart_teacher(cfg: GKDConfig) -> Iterator[str]:
    """A local teacher server for the run, READY; yields its bound address."""
    with start_local_teacher(cfg) as address:
        yield address()


@contextmanager
def teacher_service(cfg: GKDConfig) -> Iterator[Callable[[], dict[str, str]]]:
    """The call that returns every teacher's address (name -> address). With autostart a teacher's
    local server starts here and the call waits until it is READY: Ray and the actor workers start meanwhile."""
    sections = teacher_sections(cfg)
    with ExitStack() as stack:
        # Colocated roles: the teacher starts only when asked for, after the actor set up on the shared GPU.
        starting = {
            name: stack.enter_context(start_local_teacher(cfg, name))
            for name, section in sections.items()
            if section.autostart and not cfg.cluster.colocate
        }

        @functools.cache
        def addresses() -> dict[str, str]:
            bound = {}
            for name, section in sections.items():
                if not section.autostart:
                    bound[name] = section.address
                    continue
                ready = starting.get(name) or stack.enter_context(start_local_teacher(cfg, name))
                bound[name] = ready()
                print(f"{teacher_handles(cfg)[name].server} autostarted at {bound[name]}", flush=True)
            return bound

        yield addresses
