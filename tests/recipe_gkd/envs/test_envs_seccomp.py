"""The seccomp filter's program, read back instruction by instruction: what it refuses on each architecture, and a
machine without a filter refused. (Its effect inside a call: test_envs_sandbox_escapes.py.)"""

from __future__ import annotations

import struct

import pytest

from recipe_gkd.envs import seccomp


def run_filter(program: bytes, arch: int, nr: int) -> int:
    """What the kernel's classic-BPF interpreter returns for one system call (the subset the filter uses)."""
    insns = [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    data = struct.pack("=iI", nr, arch)
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            acc = struct.unpack_from("=I", data, k)[0]
        elif code in (0x15, 0x35):  # BPF_JMP | BPF_JEQ / BPF_JGE | BPF_K
            taken = acc == k if code == 0x15 else acc >= k
            pc += jt if taken else jf
        elif code == 0x06:  # BPF_RET | BPF_K
            return k
        else:
            raise AssertionError(f"unexpected instruction {code:#x}")
        pc += 1


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_refused_calls_get_eperm_and_others_pass(machine: str) -> None:
    program = seccomp.filter_program(machine)
    arch = seccomp.AUDIT_ARCH[machine]
    eperm = 0x00050000 | 1
    refused = seccomp.REFUSED_SYSCALLS[machine]
    for nr in refused.values():
        assert run_filter(program, arch, nr) == eperm, nr
    for nr in set(range(460)) - set(refused.values()):
        assert run_filter(program, arch, nr) == 0x7FFF0000, nr
    assert run_filter(program, 0x40000003, 1) == 0x80000000  # i386 (another ABI of the machine): killed
    if machine == "x86_64":
        assert run_filter(program, arch, seccomp.X32_SYSCALL_BIT | 39) == eperm


def test_a_machine_without_a_filter_is_refused() -> None:
    with pytest.raises(seccomp.UnsupportedArchitecture, match="riscv64"):
        seccomp.filter_program("riscv64")
