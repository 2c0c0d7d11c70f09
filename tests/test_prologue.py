"""Prologue analysis (unwind/prologue.py): rows for functions without CFI,
exact where they are given, none where the rule may not hold."""
import os
import subprocess

import pytest

from conftest import WORKLOADS
from reference import prologue as PR
from reference import unwind_table as RT
from pyoffcpu.native.unwind import table as T

pytestmark = pytest.mark.skipif(not PR.available(), reason="capstone is missing")
D = T.UR_DERIVED
S = 0x1000


def rows(code):
    return [(a - S, (k & ~D, off, rbp), bool(k & D)) for a, (k, off, rbp) in PR.function_rows(code, S)]


R, B, X, I, LOST = T.UR_RSP, T.UR_RBP, T.UR_RBX, T.UR_INVALID, T.RBP_LOST
END = (I, 0, 0)


def rules(code):
    """(offset, (kind, cfa_off, rbp)) of each row, all marked derived."""
    got = rows(bytes.fromhex(code))
    assert all(derived for _, _, derived in got), got
    return [(off, rule) for off, rule, _ in got]


def test_pushes_a_loop_and_the_epilogue_each_get_their_depth():
    # 0 push rbx; 1 push r12; 3 sub $0x28,%rsp; 7: dec %rdi; 10 jnz 7; 12 add $0x28,%rsp;
    # 16 pop r12; 18 pop rbx; 19 ret
    assert rules("53 4154 4883ec28 48ffcf 75fb 4883c428 415c 5b c3") == [
        (0, (R, 8, 0)), (1, (R, 16, 0)), (3, (R, 24, 0)), (7, (R, 64, 0)),
        (16, (R, 24, 0)), (18, (R, 16, 0)), (19, (R, 8, 0)), (20, END)]


def test_a_frame_pointer_carries_through_realignment_and_leave_gives_rsp_back():
    # 0 push rbp; 1 mov %rsp,%rbp; 4 and $-32,%rsp; 8 sub $64,%rsp; 12 push rbx;
    # 13 nop; 14 leave; 15 ret
    assert rules("55 4889e5 4883e4e0 4883ec40 53 90 c9 c3") == [
        (0, (R, 8, 0)), (1, (R, 16, -2)), (4, (B, 16, -2)), (15, (R, 8, 0)), (16, END)]


def test_registers_kept_with_mov_in_the_frame_and_rbp_taken_by_the_body():
    # 0 sub $0x60,%rsp; 4 mov %rbx,(%rsp); 8 mov %rbp,8(%rsp); 13 mov %rdi,%rbp; 16 nop;
    # 17 mov 8(%rsp),%rbp; 22 add $0x60,%rsp; 26 ret
    assert rules("4883ec60 48891c24 48896c2408 4889fd 90 488b6c2408 4883c460 c3") == [
        (0, (R, 8, 0)), (4, (R, 104, 0)), (13, (R, 104, -12)), (22, (R, 104, 0)), (26, (R, 8, 0)),
        (27, END)]
    # 0 push %rbx; 1 mov %rdi,%rbp (the caller's rbp kept nowhere); 4 nop; 5 pop %rbx; 6 ret
    assert rules("53 4889fd 90 5b c3") == [
        (0, (R, 8, 0)), (1, (R, 16, 0)), (4, (R, 16, LOST)), (6, (R, 8, LOST)), (7, END)]


def test_rsp_kept_in_rbx_across_a_realignment_and_a_jump():
    # 0 sub $0x60,%rsp; 4 mov %rbx,(%rsp); 8 mov %rsp,%rbx; 11 and $-4096,%rsp;
    # 18 jmp 22; 20 ud2 (never reached: no row); 22 nop; 23 mov %rbx,%rsp;
    # 26 mov (%rsp),%rbx; 30 add $0x60,%rsp; 34 ret
    got = rules("4883ec60 48891c24 4889e3 4881e400f0ffff eb02 0f0b 90 4889dc 488b1c24 4883c460 c3")
    assert got == [(0, (R, 8, 0)), (4, (R, 104, 0)), (11, (X, 104, 0)), (20, END),
                   (22, (X, 104, 0)), (26, (R, 104, 0)), (34, (R, 8, 0)), (35, END)], got


def test_two_paths_that_meet_at_different_depths_give_no_row_there_nor_after():
    # 0 push rbx; 1 test %rdi,%rdi; 4 je 8; 6 push r12; 8 nop; 9 pop rbx; 10 ret
    got = rules("53 4885ff 7402 4154 90 5b c3")
    assert got == [(0, (R, 8, 0)), (1, (R, 16, 0)), (8, END)], got


def test_a_loop_back_to_before_a_push_is_a_conflict():
    # 0 push rbx; 1 push r12; 3 dec %rdi; 6 jnz 1 (back before the push: 24 != 16)
    got = rules("53 4154 48ffcf 75f9 c3")
    assert got[:2] == [(0, (R, 8, 0)), (1, END)], got


def test_a_second_entry_inside_a_function_is_entered_with_its_own_rule():
    # 0 push rbx; 1 nop; 2 (a second symbol) nop; 3 pop rbx; 4 ret: entered at 2 the
    # CFA is rsp + 8, falling through from 1 it is rsp + 16: no row from 2 on
    got = [(a - S, (k & ~D, off, rbp)) for a, (k, off, rbp) in
           PR.function_rows(bytes.fromhex("53 90 90 5b c3"), S, entries=[S, S + 2])]
    assert got == [(0, (R, 8, 0)), (1, (R, 16, 0)), (2, END)], got
    assert PR._regions([(0x100, 0x40), (0x110, 0x10), (0x200, 0x20)]) == [
        (0x100, 0x140, [0x100, 0x110]), (0x200, 0x220, [0x200])]


# A gap of stripped code at S: f at 0 (push rbx; 1: dec rdi; 4 jnz 1; 6 pop rbx; 7 ret),
# data at 8 (0x06 does not decode), g at 11 (nop; falls off the gap's end)
GAP = bytes.fromhex("53 48ffcf 75fb 5b c3 060606 90")


def gap(candidates):
    return [(a - S, (k & ~D, off, rbp)) for a, (k, off, rbp) in PR.gap_rows(GAP, S, [S + c for c in candidates])]


def test_a_gap_is_entered_only_where_every_path_returns_at_the_entry_depth():
    f = [(0, (R, 8, 0)), (1, (R, 16, 0)), (7, (R, 8, 0)), (8, END)]
    assert gap([0]) == f
    # the loop head at 1 is at depth 16: entered there, f's ret would be at 0 (no exit at
    # the entry depth), so it is no entry; data and a candidate that runs off the gap neither
    assert gap([0, 1, 8, 11]) == f
    assert gap([1, 8, 11]) == []


def test_code_references_are_call_and_lea_targets_inside_gaps():
    # call +0x10 at 0x100 -> 0x115; lea rax, [rip + 0x20] at 0x105 -> 0x12c; a call out of the gaps
    code = bytes.fromhex("e8 10000000 488d05 20000000 e8 00100000") + bytes(0x40)

    class Sec:                      # a pyelftools section, as far as it is read
        name, data_size = ".text", len(code)

        def data(self):
            return code
    refs = PR.code_references([(0x100, 0x100 + len(code), Sec())], [(0x110, 0x130)])
    assert refs == [0x115, 0x12c], [hex(r) for r in refs]


@pytest.mark.parametrize("name,code,rows_", [
    ("a jump out (tail call)", "53 e9 00100000", [(0, (R, 8, 0)), (1, (R, 16, 0)), (6, END)]),
    ("a call keeps the depth", "53 e8 00100000 90 5b c3",
     [(0, (R, 8, 0)), (1, (R, 16, 0)), (8, (R, 8, 0)), (9, END)]),
    ("a call to the next instruction pushes", "e8 00000000 58 c3",
     [(0, (R, 8, 0)), (5, (R, 16, 0)), (6, (R, 8, 0)), (7, END)]),
    ("an rsp write not followed", "53 4883e4f0 90 5b c3", [(0, (R, 8, 0)), (1, (R, 16, 0)), (5, END)]),
    ("bytes that do not decode", "53 90 06 90", [(0, (R, 8, 0)), (1, (R, 16, 0)), (2, END)]),
    ("a jump through a register: the straight line only", "53 ffe0 90 c3",
     [(0, (R, 8, 0)), (1, (R, 16, 0)), (3, END)]),
    ("a jump into the middle of an instruction", "53 4885ff 74ff 90 5b c3",
     [(0, (R, 8, 0)), (1, (R, 16, 0)), (6, END)]),
])
def test_the_rule_stops_where_it_is_not_known(name, code, rows_):
    assert rules(code) == rows_, name


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
        t = RT.table_from_elf(f)
    spin = addr["nocfi_spin"]
    # push rbx, r12, r13 (1, 2, 2 bytes), sub $40 (4 bytes): CFA = rsp + 72 in the loop
    for off, cfa in ((0, 8), (1, 16), (3, 24), (5, 32), (9, 72), (20, 72)):
        _, cfa_off, kind, rbp = t.lookup(spin + off)
        assert (kind & ~D, cfa_off, bool(kind & D)) == (T.UR_RSP, cfa, True), (off, cfa_off, kind)
    call = addr["nocfi_call"]
    _, cfa_off, kind, rbp = t.lookup(call + 20)         # the loop, around the call
    assert (kind & ~D, cfa_off, rbp) == (T.UR_RSP, 64, -2)
