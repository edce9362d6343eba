"""The python tool's child process: set its limits, leave the network, then run the model's code.

Run as a script (`python -I sandbox_child.py LIMITS_JSON CODE_FILE`) by `recipe_gkd.envs.sandbox`; it imports
nothing of the project, only the standard library. Order matters: the resource limits are set first, then
the process enters a new user and network namespace (so even a root parent's child loses the capability
to raise them again), then Python's sockets are refused, then the code runs as `__main__`.
"""

from __future__ import annotations

import ctypes
import json
import linecache
import os
import resource
import socket
import sys
import traceback

CLONE_NEWUSER = 0x10000000  # <linux/sched.h>
CLONE_NEWNET = 0x40000000
NETWORK_REFUSED = "network access is disabled in the python tool"
# Exit status when the namespace the parent asked for cannot be entered (the parent reports it as such).
EXIT_NO_NAMESPACE = 97
CODE_NAME = "<tool_code>"  # the file name tracebacks show for the model's code


def set_limits(memory_bytes: int, cpu_seconds: int, max_file_bytes: int) -> None:
    """Address space, CPU seconds (SIGXCPU past the soft limit) and the size of any file written."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def enter_network_namespace() -> int:
    """unshare(2) into a fresh user + network namespace: only a loopback interface, down. 0 or the errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        return ctypes.get_errno()
    return 0


def refuse_sockets() -> None:
    """Every socket Python's `socket` module makes raises PermissionError (code in this process only)."""

    class RefusedSocket(socket.socket):
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise PermissionError(NETWORK_REFUSED)

    def refused(*args: object, **kwargs: object) -> None:
        raise PermissionError(NETWORK_REFUSED)

    socket.socket = RefusedSocket  # type: ignore[misc]
    for name in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo"):
        setattr(socket, name, refused)


def main(argv: list[str]) -> None:
    limits = json.loads(argv[1])
    set_limits(limits["memory_bytes"], limits["cpu_seconds"], limits["max_file_bytes"])
    if limits["network_namespace"]:
        errno = enter_network_namespace()
        if errno:
            print(f"cannot enter a network namespace: {os.strerror(errno)}", file=sys.stderr)
            sys.exit(EXIT_NO_NAMESPACE)
    refuse_sockets()
    with open(argv[2], encoding="utf-8") as f:
        source = f.read()
    sys.argv = [CODE_NAME]
    run_code(source)


def run_code(source: str) -> None:
    """Run the model's code as `__main__`; an exception prints a traceback of its own frames only, exit 1."""
    linecache.cache[CODE_NAME] = (len(source), None, source.splitlines(True), CODE_NAME)
    try:
        exec(compile(source, CODE_NAME, "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as err:  # noqa: BLE001 - the model's code failed: tell it how, without this file's frames
        traceback.print_exception(type(err), err, err.__traceback__.tb_next if err.__traceback__ else None)
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv)
