"""Prologue analysis (unwind/prologue.py): rows for functions without CFI,
exact where they are given, none where the rule may not hold."""
import os
import subprocess

import pytest

from conftest import WORKLOADS
from pyoffcpu.unwind import prologue as PR
from pyoffcpu.unwind import table as T

pytestmark = pytest.mark.skipif(not PR.available(), reason="capstone is missing")
D = T.UR_DERIVED
S = 0x1000


def rows(code):
    return [(a - S, (k & ~D, off, rbp), bool(k & D)) for a, (k, off, rbp) in PR.function_rows(code, S)]


def test_pushes_and_a_frame_then_the_loop_then_no_row_from_the_epilogue():
    # push rbx; push r12; sub $0x28,%rsp; 1: dec %rdi; jnz 1b; add $0x28,%rsp; pop r12; pop rbx; ret
    code = bytes.fromhex("53 4154 4883ec28 48ffcf 75fb 4883c428 415c 5b c3")
    assert rows(code) == [(0, (T.UR_RSP, 8, 0), True), (1, (T.UR_RSP, 16, 0), True),
                          (3, (T.UR_RSP, 24, 0), True), (7, (T.UR_RSP, 64, 0), True),
                          (12, (T.UR_INVALID, 0, 0), True)]


def test_a_frame_pointer_carries_through_realignment_until_leave():
    # push rbp; mov %rsp,%rbp; and $-32,%rsp; sub $64,%rsp; push rbx; nop; leave; ret
    code = bytes.fromhex("55 4889e5 4883e4e0 4883ec40 53 90 c9 c3")
    assert rows(code) == [(0, (T.UR_RSP, 8, 0), True), (1, (T.UR_RSP, 16, -2), True),
                          (4, (T.UR_RBP, 16, -2), True), (14, (T.UR_INVALID, 0, 0), True)]


def test_registers_kept_with_mov_in_the_frame_and_rbp_taken_by_the_body():
    # sub $0x60,%rsp; mov %rbx,(%rsp); mov %rbp,8(%rsp); mov %rdi,%rbp; nop; add $0x60,%rsp
    code = bytes.fromhex("4883ec60 48891c24 48896c2408 4889fd 90 4883c460 c3")
    assert rows(code) == [(0, (T.UR_RSP, 8, 0), True), (4, (T.UR_RSP, 104, 0), True),
                          (13, (T.UR_RSP, 104, -12), True), (17, (T.UR_INVALID, 0, 0), True)]
    # push %rbx; mov %rdi,%rbp (the caller's rbp kept nowhere); nop; pop %rbx
    code = bytes.fromhex("53 4889fd 90 5b c3")
    assert rows(code) == [(0, (T.UR_RSP, 8, 0), True), (1, (T.UR_RSP, 16, T.RBP_LOST), True),
                          (5, (T.UR_INVALID, 0, 0), True)]


@pytest.mark.parametrize("name,code,stop", [
    ("an unconditional jump", "53 eb00 90 5b c3", 1),           # push rbx; jmp .+2: what follows may differ
    ("a jump out (tail call)", "53 e9 00100000", 1),            # push rbx; jmp far away
    ("a call keeps the depth", "53 e8 00000000 90 5b c3", 7),   # push rbx; call; nop; pop rbx
    ("a pop in the body", "53 4883ec08 90 58 90", 6),          # push; sub; nop; pop rax
    ("bytes that do not decode", "53 90 06 90", 2),             # 0x06 is not an x86-64 instruction
])
def test_the_rule_stops_where_it_may_not_hold(name, code, stop):
    got = rows(bytes.fromhex(code))
    assert got[-1] == (stop, (T.UR_INVALID, 0, 0), True), (name, got)
    assert all(r[0] < stop for r in got[:-1]), (name, got)


def test_only_functions_no_fde_touches():
    fdes = [(0x100, 0x200), (0x300, 0x340)]
    syms = [(0x100, 0x40), (0x200, 0x50), (0x2f0, 0x20), (0x400, 0x10), (0x400, 0x8), (0x500, 0)]
    # 0x100 is an FDE's, 0x2f0 runs into one, 0x500 has no size; of two at 0x400, the shorter
    assert PR.uncovered_functions(syms, fdes) == [(0x200, 0x50), (0x400, 0x8)]


def test_the_fixture_kernels_get_rows_and_the_c_functions_keep_their_fdes(tmp_path):
    """nocfi_kernel.S has no CFI: its two kernels get derived rows in the
    table; the C functions' rows are their FDEs' (not derived)."""
    so = tmp_path / "k.so"
    subprocess.run(["gcc", "-O2", "-fomit-frame-pointer", "-shared", "-fPIC", "-o", str(so),
                    os.path.join(WORKLOADS, "nocfi_kernel.S")], check=True)
    nm = subprocess.run(["nm", str(so)], capture_output=True, text=True, check=True).stdout
    addr = {ln.split()[2]: int(ln.split()[0], 16) for ln in nm.splitlines() if len(ln.split()) == 3}
    with open(so, "rb") as f:
        t = T.table_from_elf(f)
    spin = addr["nocfi_spin"]
    # push rbx, r12, r13 (1, 2, 2 bytes), sub $40 (4 bytes): CFA = rsp + 72 in the loop
    for off, cfa in ((0, 8), (1, 16), (3, 24), (5, 32), (9, 72), (20, 72)):
        _, cfa_off, kind, rbp = t.lookup(spin + off)
        assert (kind & ~D, cfa_off, bool(kind & D)) == (T.UR_RSP, cfa, True), (off, cfa_off, kind)
    call = addr["nocfi_call"]
    _, cfa_off, kind, rbp = t.lookup(call + 20)         # the loop, around the call
    assert (kind & ~D, cfa_off, rbp) == (T.UR_RSP, 64, -2)
