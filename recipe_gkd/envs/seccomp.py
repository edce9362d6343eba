"""The python tool's seccomp filter: the system calls no namespace covers, or that only widen the kernel's attack
surface, refused with EPERM inside bubblewrap (`bwrap --seccomp FD`).

- the kernel's keyrings (`keyctl`, `add_key`, `request_key`) are not namespaced: a call running as a root caller's
  uid could read root's keyrings by id, and it holds the caller's session keyring;
- `bpf`, `perf_event_open`, `userfaultfd`, the `io_uring_*` calls and `open_by_handle_at`, `kexec_*`: no Python
  program needs them, and they are where kernel exploits have come from (Docker's default profile refuses them
  too; most need a capability the call does not hold anyway).
Any other ABI of the machine (i386 on x86_64, the x32 calls) is refused whole. The filter is a classic BPF program
written here (no libseccomp): a few instructions per architecture, for x86_64 and aarch64; on another machine the
bwrap isolation is refused, not run without it.
"""

from __future__ import annotations

import errno
import os
import struct

# <linux/audit.h>
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# <asm/unistd_64.h> (x86_64) and <asm-generic/unistd.h> (aarch64)
REFUSED_SYSCALLS = {
    "x86_64": {
        "add_key": 248,
        "request_key": 249,
        "keyctl": 250,
        "kexec_load": 246,
        "perf_event_open": 298,
        "open_by_handle_at": 304,
        "kexec_file_load": 320,
        "bpf": 321,
        "userfaultfd": 323,
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
    },
    "aarch64": {
        "kexec_load": 104,
        "add_key": 217,
        "request_key": 218,
        "keyctl": 219,
        "perf_event_open": 241,
        "open_by_handle_at": 265,
        "bpf": 280,
        "userfaultfd": 282,
        "kexec_file_load": 294,
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
    },
}
X32_SYSCALL_BIT = 0x40000000  # x86_64's x32 ABI: the same arch value, syscall numbers from here on
# <linux/filter.h>, <linux/seccomp.h>
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_RET_K = 0x06
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_RET_KILL_PROCESS = 0x80000000
# struct seccomp_data: int nr; __u32 arch; ...
_NR_OFFSET, _ARCH_OFFSET = 0, 4


class UnsupportedArchitecture(RuntimeError):
    """No filter is written for this machine's architecture."""


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)  # struct sock_filter


def filter_program(machine: str | None = None) -> bytes:
    """The BPF program (an array of struct sock_filter) for `machine` (default: this one's `uname -m`)."""
    machine = machine or os.uname().machine
    if machine not in AUDIT_ARCH:
        raise UnsupportedArchitecture(f"no seccomp filter is written for {machine} (only {', '.join(AUDIT_ARCH)})")
    numbers = sorted(REFUSED_SYSCALLS[machine].values())
    checks = [(_JGE_K, X32_SYSCALL_BIT)] if machine == "x86_64" else []
    checks += [(_JEQ_K, nr) for nr in numbers]
    program = [
        _insn(_LD_W_ABS, 0, 0, _ARCH_OFFSET),
        _insn(_JEQ_K, 1, 0, AUDIT_ARCH[machine]),
        _insn(_RET_K, 0, 0, _RET_KILL_PROCESS),  # another ABI of this machine: its numbers differ, refuse it whole
        _insn(_LD_W_ABS, 0, 0, _NR_OFFSET),
    ]
    # Each check jumps, when it matches, over the checks after it and the ALLOW to the final ERRNO.
    for index, (code, value) in enumerate(checks):
        program.append(_insn(code, len(checks) - index, 0, value))
    program.append(_insn(_RET_K, 0, 0, _RET_ALLOW))
    program.append(_insn(_RET_K, 0, 0, _RET_ERRNO | errno.EPERM))
    return b"".join(program)
