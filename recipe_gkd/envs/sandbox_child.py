"""The python tool's child process: set its per-process limits (and the socket guard), run the model's code.

Run as a script (`python -I [-S] -u sandbox_child.py LIMITS... CODE_FILE`, see `main`) by `recipe_gkd.envs.sandbox`:
inside bubblewrap (read-only at /sandbox/child.py), or as a plain child with `tool_isolation=socket_guard`, the one
mode that refuses Python's sockets here (bubblewrap's network namespace has no network to refuse). It imports
nothing of the project and as little of the standard library as it can: every call pays for its imports. The
limits are set before the code runs; inside bubblewrap the process holds no capability, so it cannot raise them.
"""

from __future__ import annotations

import resource
import sys

NETWORK_REFUSED = "network access is disabled in the python tool"
CODE_NAME = "<tool_code>"  # the file name tracebacks show for the model's code


def set_limits(memory_bytes: int, cpu_seconds: int, max_file_bytes: int) -> None:
    """Address space, CPU seconds (SIGXCPU past the soft limit) and the size of any file written."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def refuse_sockets() -> None:
    """Every socket Python's `socket` module makes raises PermissionError (code in this process only)."""
    import socket  # here, not at the top: 7 ms of every bubblewrap call, which does not use it

    class RefusedSocket(socket.socket):
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise PermissionError(NETWORK_REFUSED)

    def refused(*args: object, **kwargs: object) -> None:
        raise PermissionError(NETWORK_REFUSED)

    socket.socket = RefusedSocket  # type: ignore[misc]
    for name in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo"):
        setattr(socket, name, refused)


def main(argv: list[str]) -> None:
    """argv: MEMORY_BYTES CPU_SECONDS MAX_FILE_BYTES SOCKET_GUARD(0|1) CODE_FILE."""
    memory_bytes, cpu_seconds, max_file_bytes, guard = (int(value) for value in argv[1:5])
    set_limits(memory_bytes, cpu_seconds, max_file_bytes)
    if guard:
        refuse_sockets()
    with open(argv[5], encoding="utf-8") as f:
        source = f.read()
    sys.argv = [CODE_NAME]
    run_code(source)


def run_code(source: str) -> None:
    """Run the model's code as `__main__`; an exception prints a traceback of its own frames only, exit 1."""
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(source, CODE_NAME, "exec"), namespace)
    except SystemExit:
        raise
    except BaseException as err:  # noqa: BLE001 - the model's code failed: tell it how, without this file's frames
        report(err, source, namespace)
        sys.exit(1)


def report(err: BaseException, source: str, namespace: dict[str, object]) -> None:
    """Print the traceback of the model's frames. traceback and linecache are imported only here (they took
    25 ms of every call's start), after the program's objects are dropped: a MemoryError still has room for them."""
    tb = err.__traceback__.tb_next if err.__traceback__ else None
    namespace.clear()
    frames = tb
    while frames is not None:
        try:
            frames.tb_frame.clear()  # its locals; the code and line numbers the traceback prints stay
        except RuntimeError:
            pass  # a frame still running (a generator's that the program kept): left as it is
        frames = frames.tb_next
    import linecache
    import traceback

    linecache.cache[CODE_NAME] = (len(source), None, source.splitlines(True), CODE_NAME)
    traceback.print_exception(type(err), err, tb)


if __name__ == "__main__":
    main(sys.argv)
