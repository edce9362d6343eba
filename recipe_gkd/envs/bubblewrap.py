"""bubblewrap's command line for one python tool call: its namespaces and the little it sees.

bubblewrap (`bwrap`, the sandbox Flatpak runs apps in) rather than nsjail: Debian packages it (0.8.0 in Debian 12)
and nsjail is not, it needs no daemon and no root (an unprivileged user namespace), and it does one job: set up
namespaces and mounts, then execute the command. The call gets its own user, mount, PID, IPC, network, UTS and
cgroup namespaces and sees, read-only, only the interpreter (its binary, its shared library and its standard
library under /python, its site-packages hidden) and the system's shared libraries (/usr/lib: no /usr/bin, no
/etc, no shell); `/proc` shows the call's own processes;
`/tmp` (its working directory and HOME) and `/dev/shm` are tmpfs mounts of a fixed size that die with the
call's mount namespace. Nothing of the repository, no home directory, no host `/tmp`: the unix sockets there
(Ray's session sockets live under /tmp/ray) cannot be named, and abstract ones belong to the host's network
namespace. The sandbox's own script and the model's code are read-only files in it; a seccomp filter refuses the
few system calls no namespace covers (envs/seccomp.py). `--die-with-parent` and the
PID namespace end every process of the call when its first one ends, or when bwrap or its caller is killed.
"""

from __future__ import annotations

import functools
import os
import site
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Where the sandbox's own files appear inside it (read-only).
CHILD_PATH = "/sandbox/child.py"
CODE_PATH = "/sandbox/tool_code.py"
SCRATCH = "/tmp"
# The system's shared libraries (libc, libm, libssl for the ssl module, libffi for ctypes, ...): each is bound
# read-only where it is a directory and recreated where it is a symlink (a merged /usr: /lib -> usr/lib).
SYSTEM_LIBRARY_DIRS = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32")
NAMESPACE_FLAGS = (
    "--unshare-user",
    "--unshare-pid",
    "--unshare-ipc",
    "--unshare-net",
    "--unshare-uts",
    "--unshare-cgroup",
    "--disable-userns",  # no nested user namespace: the kernel's largest attack surface stays closed
    "--die-with-parent",  # SIGKILL to the call when bwrap's caller dies (a killed rollout worker)
    "--new-session",  # no TIOCSTI into a terminal the caller holds
    "--cap-drop",
    "ALL",
    "--hostname",
    "python-tool",
)
# The interpreter's installation appears here, whatever its host path (a pyenv build under /root): no home.
SANDBOX_PREFIX = "/python"


def _inside(path: str, directories: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in directories)


@dataclass(frozen=True)
class InterpreterView:
    """What the call sees of the interpreter: host paths bound read-only at paths under SANDBOX_PREFIX."""

    executable: str  # inside
    binds: tuple[tuple[str, str], ...]  # (host, inside): the binary, its lib/ (libpython), its standard library
    hidden: tuple[str, ...]  # inside: site-packages directories, covered by an empty read-only tmpfs
    library_path: str  # inside: LD_LIBRARY_PATH for a shared libpython whose rpath names its host path; "" if none

    def mount_args(self) -> list[str]:
        args: list[str] = []
        for name in SYSTEM_LIBRARY_DIRS:
            if os.path.islink(name):
                args += ["--symlink", os.readlink(name), name]
            elif os.path.isdir(name):
                args += ["--ro-bind", name, name]
        for host, inside in self.binds:
            args += ["--ro-bind", host, inside]
        bin_dir, binary = os.path.split(self.executable)
        for alias in ("python3", "python"):  # what `subprocess.run(["python3", ...])` finds on PATH
            if binary != alias:
                args += ["--symlink", binary, os.path.join(bin_dir, alias)]
        for directory in self.hidden:
            args += ["--tmpfs", directory, "--remount-ro", directory]
        return args


@functools.cache
def interpreter_view() -> InterpreterView:
    """This interpreter's base installation (a venv's interpreter is its base's; the venv itself stays out)."""
    prefix = os.path.realpath(sys.base_prefix)

    def inside(host: str) -> str:
        return SANDBOX_PREFIX + "/" + os.path.relpath(host, prefix) if _inside(host, [prefix]) else host

    executable = os.path.realpath(sys._base_executable)
    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    libdir = os.path.realpath(str(sysconfig.get_config_var("LIBDIR") or stdlib))
    dynload = os.path.realpath(str(sysconfig.get_config_var("DESTSHARED") or stdlib))
    system = list(SYSTEM_LIBRARY_DIRS)
    # libpython (shared in pyenv, conda and source builds) and, under conda, the libraries the standard library's
    # extension modules link live in LIBDIR; a distribution's LIBDIR is a system directory, bound anyway.
    own_lib = libdir if os.path.isdir(libdir) and not _inside(libdir, system) else ""
    dirs: list[str] = []
    for directory in (own_lib, stdlib, dynload):
        if directory and os.path.isdir(directory) and not _inside(directory, dirs):
            dirs.append(directory)
    hidden: list[str] = []
    for site_dir in site.getsitepackages([sys.base_prefix, sys.base_exec_prefix]):
        real = os.path.realpath(site_dir)
        if os.path.isdir(real) and _inside(real, dirs):
            hidden.append(inside(real))
        if os.path.isdir(real) and _inside(real, system):  # also visible at its own path, with the system's
            hidden.append(real)
    return InterpreterView(
        executable=inside(executable),
        binds=((executable, inside(executable)), *((d, inside(d)) for d in dirs)),
        hidden=tuple(dict.fromkeys(hidden)),
        library_path=inside(own_lib) if own_lib else "",
    )


def sandbox_env(view: InterpreterView) -> dict[str, str]:
    """The call's whole environment (bwrap --clearenv): nothing of the caller's."""
    env = {
        "PATH": os.path.dirname(view.executable),
        "HOME": SCRATCH,
        "TMPDIR": SCRATCH,
        "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
    }
    if view.library_path:
        env["LD_LIBRARY_PATH"] = view.library_path
    return env


def bwrap_command(
    bwrap: str,
    view: InterpreterView,
    child_script: Path,
    code_fd: int,
    seccomp_fd: int,
    child_args: list[str],
    scratch_bytes: int,
) -> list[str]:
    """bwrap's argv running `python -I -S -u CHILD_PATH *child_args` on the model's code read from `code_fd`, under
    the seccomp filter read from `seccomp_fd` (envs/seccomp.py)."""
    env: list[str] = []
    for key, value in sandbox_env(view).items():
        env += ["--setenv", key, value]
    return [
        bwrap,
        *NAMESPACE_FLAGS,
        "--seccomp",
        str(seccomp_fd),
        *view.mount_args(),
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(scratch_bytes),
        "--tmpfs",
        "/dev/shm",  # POSIX semaphores and shared memory (multiprocessing), sized like the scratch
        "--remount-ro",
        "/dev",
        "--size",
        str(scratch_bytes),
        "--perms",
        "1777",
        "--tmpfs",
        SCRATCH,
        "--ro-bind",
        str(child_script),
        CHILD_PATH,
        "--ro-bind-data",
        str(code_fd),
        CODE_PATH,
        "--remount-ro",
        "/",  # bwrap's own root tmpfs: no file outside the two scratch mounts can be made
        "--chdir",
        SCRATCH,
        "--clearenv",
        *env,
        "--",
        # -I: no PYTHON* variables, no user site; -S: no site-packages at all (the standard library only);
        # -u: unbuffered, so what was printed before a kill is still read.
        view.executable,
        "-I",
        "-S",
        "-u",
        CHILD_PATH,
        *child_args,
    ]
