"""Unwind rows for functions no FDE covers, from their own instructions.

Hand-written assembly (BLAS and GEMM kernels, vectorised math) often ships
without CFI, so .eh_frame has nothing for it and every stack stops there.
For each function the symbol tables know (.symtab, .dynsym: start and size)
that no FDE touches, its instructions are decoded (capstone, text-only
mode: ten times faster than its detail mode) and its control flow followed
from the entry, where CFA = rsp + 8.  Every instruction gets the rule in
force before it (the row a pc there needs), from what the instructions on
the way did:

- `push`/`pop`, `sub`/`add $N, %rsp`, `lea N(%rsp), %rsp` move the CFA;
  `push %rbp`, or `mov %rbp, X(%rsp)` in the prologue, records where the
  caller's rbp is, and `pop %rbp` / `mov X(%rsp), %rbp` from there gives
  it back;
- `mov %rsp, %rbp` makes the rule rbp-based (CFA = rbp + N), which holds
  whatever rsp does (`and $-32, %rsp`, pushes) until rbp is written;
  `leave` and `mov %rbp, %rsp` make it rsp-based again;
- `mov %rsp, %rbx` makes it rbx-based (UR_RBX, OpenBLAS's GEMM kernels,
  which then align the stack to 4 KiB), followed by BPF in the leaf frame
  only, where rbx is the sampled register; `mov %rbx, %rsp` gives it back;
- a call keeps the rule (it gives back what it takes; rbp and rbx are
  callee-saved); a direct jump inside the function carries it to its
  target, a conditional one to both ways; `ret`, a jump out (a tail call)
  and `ud2` end the path.

An instruction reached by two paths with different rules, one after an
instruction whose effect is not followed (another write to rsp, or to the
frame register), and the code after it get no row (CONFLICT).  A function
with a jump through a register or memory, or a direct jump to an address
the linear sweep did not decode, is followed along its straight line only:
its control flow is not known.  Code no path reaches, and bytes capstone
cannot decode, get no row either: the walk stops there, it never guesses.
A body that writes rbp when the caller's rbp was kept nowhere makes it
unknown from there on (RBP_LOST): a caller whose CFA is rbp-based then
ends the walk.  The rows are marked UR_DERIVED, so the unwinder can count
the frames that needed them.
"""
from __future__ import annotations

import os
from typing import Iterable, List, Optional, Sequence, Tuple

from .. import bpfdefs

UR_DERIVED = bpfdefs.value("UR_DERIVED")
UR_RSP, UR_RBP, UR_RBX, UR_INVALID = (bpfdefs.value(n) for n in ("UR_RSP", "UR_RBP", "UR_RBX", "UR_INVALID"))
RBP_LOST = bpfdefs.value("RBP_LOST")
MAX_FUNCTION_BYTES = 1 << 20        # longer "functions" are not decoded (a symbol's size gone wrong)
PROLOGUE_MAX = 24                   # instructions looked at for a prologue

# one derived row: (address, (kind, cfa_off, rbp))
Row = Tuple[int, Tuple[int, int, int]]


def _capstone():
    try:
        import capstone
    except ImportError:
        return None
    return capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)    # lite decoding: text only


def available() -> bool:
    return _capstone() is not None


def enabled() -> bool:
    """Prologue analysis is on unless PYOFFCPU_PROLOGUE=0 (for measuring what
    it costs and buys: make bench case 14)."""
    return os.environ.get("PYOFFCPU_PROLOGUE", "1") != "0"


# Instructions that move rsp without naming it as their destination (a call
# gives back what it takes: it keeps the caller's depth).
IMPLICIT_RSP = frozenset({"push", "pushfq", "pushf", "pop", "popfq", "popf", "leave", "enter",
                          "ret", "retf", "iretq", "iret", "iretd"})
EXCHANGES = ("xchg", "xadd", "cmpxchg")
RSP_NAMES = frozenset({"rsp", "esp", "sp", "spl"})
RBP_NAMES = frozenset({"rbp", "ebp", "bp", "bpl"})
RBX_NAMES = frozenset({"rbx", "ebx", "bx", "bl", "bh"})
RBX_IMPLICIT = frozenset({"cpuid"})     # writes rbx without naming it
ENDS = frozenset({"ret", "retf", "leave", "iretq", "iret", "iretd", "jmp", "ljmp", "ud2", "hlt"})
GPRS = frozenset("rax rbx rcx rdx rsi rdi rbp rsp r8 r9 r10 r11 r12 r13 r14 r15".split())


def _int(text: str) -> Optional[int]:
    try:
        return int(text, 0)
    except ValueError:
        return None


def _writes(m: str, ops: str, names: frozenset) -> bool:
    """Might this instruction write one of the registers `names`?  Read
    from capstone's text (Intel syntax: the destination first); in doubt,
    yes (a rule that stops early loses a frame, never adds one)."""
    first = ops.split(",", 1)[0].strip()
    if first in names:
        return True
    if m.startswith(EXCHANGES):
        return any(tok.strip(" []") in names for tok in ops.replace(",", " ").split())
    return False


# a state of the analysis: the rule before an instruction, (kind, cfa_off, rbp)
State = Tuple[int, int, int]
CONFLICT = (-1, 0, 0)                   # reached with two rules: no row, nor below it


def function_rows(code: bytes, start: int, md=None, entries: Sequence[int] = (), fast: bool = True
                  ) -> List[Row]:
    """The rows of one function (its bytes at `start`): the rule before each
    instruction, found by following the function's control flow from its
    entry (and from `entries`, other symbols inside it, called as functions
    too); UR_INVALID where it is not known.  fast=False takes every
    instruction the slow way (the tests check both give the same rows)."""
    md = md or _capstone()
    if md is None:
        return []
    insns = list(md.disasm_lite(code, start))
    if not insns:
        return []
    end = start + len(code)
    starts = {a for a, _, _, _ in insns}
    # every direct jump inside the function must land on an instruction the
    # sweep decoded, and nothing may jump through a register or memory: else
    # the control flow is not known and only the straight line is followed
    follow = True
    for a, size, m, ops in insns:
        if m.startswith(("j", "loop")):
            target = _int(ops.strip())
            if target is None or start <= target < end and target not in starts:
                follow = False
    prologue = set()
    for a, size, m, ops in insns[:PROLOGUE_MAX]:
        if m.startswith(("j", "call", "loop")) or m in ENDS:
            break
        prologue.add(a)
    at = {a: i for i, (a, _, _, _) in enumerate(insns)}
    state: dict = {start: (UR_RSP, 8, 0)}
    for e in entries:
        if e != start and e in starts:
            state[e] = (UR_RSP, 8, 0)
        elif e != start:
            return [(start, (UR_INVALID | UR_DERIVED, 0, 0))]  # an entry the sweep did not decode
    work = list(state)
    while work:
        addr = work.pop()
        st = state[addr]
        a, size, m, ops = insns[at[addr]]
        if fast and ops[:2] not in _MAYBE_FRAME_REG and m not in _SPECIAL and m[0] != "j" and \
                not m.startswith(_SPECIAL_PREFIXES) and a not in prologue:
            succ = [(a + size, st)]     # most instructions: the rule goes on unchanged
        else:
            succ = _successors(a, size, m, ops, st, start, end, follow, a in prologue)
        for nxt, nst in succ:
            if nxt not in at:
                continue                # past the bytes decoded: no row
            old = state.get(nxt)
            if old is None:
                state[nxt] = nst
            elif old != nst and old != CONFLICT:
                state[nxt] = CONFLICT
            else:
                continue
            work.append(nxt)
    rows: List[Row] = []
    for a, size, m, ops in insns:
        st = state.get(a)
        enc = (UR_INVALID | UR_DERIVED, 0, 0) if st is None or st == CONFLICT else (st[0] | UR_DERIVED,) + st[1:]
        if not rows or rows[-1][1] != enc:
            rows.append((a, enc))
    last = insns[-1]
    if rows[-1][1][0] != UR_INVALID | UR_DERIVED:
        rows.append((last[0] + last[1], (UR_INVALID | UR_DERIVED, 0, 0)))
    return rows


# The fast path of the analysis: an instruction whose first operand (its
# destination) does not start like rsp/rbp/rbx or one of their parts, and
# that is no stack, control or exchange instruction, keeps the rule (in the
# prologue, a store of rbp into the frame does not: the slow path).
_MAYBE_FRAME_REG = frozenset({"rs", "es", "sp", "rb", "eb", "bp", "bx", "bl", "bh"})
_SPECIAL = IMPLICIT_RSP | ENDS | RBX_IMPLICIT | frozenset({"endbr64"})
_SPECIAL_PREFIXES = ("call", "loop", "xchg", "xadd", "cmpxchg", "iret", "push", "pop")


def _successors(a: int, size: int, m: str, ops: str, st: State, start: int, end: int,
                follow: bool, in_prologue: bool) -> List[Tuple[int, State]]:
    """The instructions after one (its address, the rule before it) along the
    function's control flow, with the rule before each: CONFLICT where this
    instruction loses the rule (an execution that goes on from here is at a
    depth not known), none where the frame ends (ret, a tail call)."""
    nxt = a + size
    if m == "leave" and st != CONFLICT and st[0] == UR_RBP:
        # mov %rbp, %rsp; pop %rbp: rsp back at the frame, rbp the caller's
        # when it was pushed right above the frame (cfa - 8 below the CFA)
        _, cfa, rbp = st
        return [(nxt, (UR_RSP, cfa - 8, 0 if rbp != RBP_LOST and rbp * 8 == -cfa else RBP_LOST))]
    if m in ENDS and m != "jmp":
        return []                       # ret, ud2...: the frame ends here
    if m.startswith(("j", "loop")):
        if not follow:
            return []                   # the control flow is not known: the straight line only
        target = _int(ops.strip())
        inside = target is not None and start <= target < end
        if m == "jmp":
            return [(target, st)] if inside else []     # else a tail call
        return [(nxt, st)] + ([(target, st)] if inside else [])
    if st == CONFLICT:
        return [(nxt, CONFLICT)]
    kind, cfa, rbp = st
    if m.startswith("call"):
        if _int(ops.strip()) == nxt:    # a call to the next instruction: a push (PIC code)
            return [(nxt, (kind, cfa + 8, rbp) if kind == UR_RSP else st)]
        return [(nxt, st)]              # gives back what it takes; rbp, rbx are callee-saved
    new = _step(m, ops, kind, cfa, rbp, in_prologue)
    if new is None or not 8 <= new[1] < 32768:
        return [(nxt, CONFLICT)]        # not a rule this table can say from here
    return [(nxt, new)]


def _step(m: str, ops: str, kind: int, cfa: int, rbp: int, in_prologue: bool) -> Optional[State]:
    """The rule after a straight-line instruction; None when it is lost."""
    if kind == UR_RSP:
        if m == "push":
            cfa += 8
            if ops == "rbp" and rbp == 0:
                rbp = -cfa // 8         # the caller's rbp at CFA - cfa
            return kind, cfa, rbp
        if m in ("pushfq", "pushf"):
            return kind, cfa + 8, rbp
        if m in ("popfq", "popf"):
            return kind, cfa - 8, rbp
        if m == "pop":
            if ops in RBP_NAMES:
                if rbp in (0, RBP_LOST):
                    rbp = RBP_LOST      # a value of the body's, not the caller's
                elif rbp * 8 == -cfa:
                    rbp = 0             # the caller's, from where it was pushed
            elif ops in RSP_NAMES:
                return None
            return _moved(kind, cfa - 8, rbp)
        if m in ("sub", "add") and ops.startswith("rsp, "):
            imm = _int(ops[5:].strip())
            if imm is None:
                return None
            return _moved(kind, cfa + imm if m == "sub" else cfa - imm, rbp)
        if m == "lea" and ops.startswith("rsp, [rsp"):
            rest = ops[len("rsp, [rsp"):].strip()
            disp = 0 if rest == "]" else _int(rest[:-1].replace(" ", "")) if rest.endswith("]") else None
            return None if disp is None else _moved(kind, cfa - disp, rbp)
        slot = _frame_slot(m, ops, cfa, load=True)
        if slot is not None and slot[0] == "rbp" and rbp not in (0, RBP_LOST):
            # `mov rbp, qword ptr [rsp + X]`: from its slot, the caller's again
            return kind, cfa, 0 if slot[1] - cfa == rbp * 8 else rbp
        if m == "mov" and ops == "rbp, rsp":
            # a frame pointer: CFA = rbp + cfa from here on, whatever rsp does
            return UR_RBP, cfa, rbp if rbp != 0 else RBP_LOST
        if m == "mov" and ops == "rbx, rsp":
            # rsp kept in rbx before a realignment (OpenBLAS's GEMM kernels):
            # BPF follows it in the leaf frame only, where rbx is sampled
            return UR_RBX, cfa, rbp
        if m in IMPLICIT_RSP or _writes(m, ops, RSP_NAMES):
            return None
        if in_prologue:
            store = _frame_slot(m, ops, cfa)
            if store is not None and store[0] == "rbp" and rbp == 0:
                # `mov qword ptr [rsp + X], rbp`: the caller's rbp kept in the frame
                return kind, cfa, (store[1] - cfa) // 8
    elif kind == UR_RBP:
        if m == "mov" and ops == "rsp, rbp":
            return UR_RSP, cfa, rbp     # rsp at the frame again
        if m == "pop" and ops in RBP_NAMES or m == "enter" or _writes(m, ops, RBP_NAMES):
            return None
        return kind, cfa, rbp
    elif kind == UR_RBX:
        if m == "mov" and ops == "rsp, rbx":
            return UR_RSP, cfa, rbp     # rsp back from its copy
        if m in RBX_IMPLICIT or m == "pop" and ops in RBX_NAMES or _writes(m, ops, RBX_NAMES):
            return None
    if rbp == 0 and (m == "pop" and ops in RBP_NAMES or _writes(m, ops, RBP_NAMES)):
        # the body takes rbp for itself and the caller's was kept nowhere: from
        # here on it is not known (a caller whose CFA is rbp-based then ends
        # the walk, instead of being walked from garbage)
        rbp = RBP_LOST
    return kind, cfa, rbp


def _frame_slot(m: str, ops: str, cfa: int, load: bool = False) -> Optional[Tuple[str, int]]:
    """(REG, X) for `mov qword ptr [rsp + X], REG` (load: `mov REG, qword
    ptr [rsp + X]`) with X a slot of this frame below the return address."""
    if m != "mov":
        return None
    if load:
        reg, _, where = ops.partition(", ")
    else:
        where, _, reg = ops.partition(", ")
    if reg not in GPRS or not where.startswith("qword ptr [rsp") or not where.endswith("]"):
        return None
    rest = where[len("qword ptr [rsp"):-1].replace(" ", "")
    x = 0 if rest == "" else _int(rest) if rest.startswith("+") else None
    if x is None or x < 0 or x % 8 or x + 8 > cfa - 8:
        return None                     # not a slot of this frame below the return address
    return reg, x


def _moved(kind: int, cfa: int, rbp: int) -> State:
    """The rule after rsp moved up or down to `cfa`: a caller's rbp kept in a
    slot rsp has left behind is no longer safe to read."""
    if rbp not in (0, RBP_LOST) and -8 * rbp > cfa:
        rbp = RBP_LOST
    return kind, cfa, rbp


def _inside(ops: str, start: int, end: int) -> bool:
    """A direct jump to an address inside the function."""
    target = _int(ops.strip())
    return target is not None and start <= target < end


def uncovered_functions(symbols: Iterable[Tuple[int, int]], covered: Sequence[Tuple[int, int]]
                        ) -> List[Tuple[int, int]]:
    """The (start, size) of the functions no FDE range touches."""
    import bisect
    spans = sorted(covered)
    starts = [s for s, _ in spans]
    out = set()
    for start, size in symbols:
        if size <= 0 or size > MAX_FUNCTION_BYTES:
            continue
        end = start + size
        i = bisect.bisect_right(starts, end - 1) - 1     # the last FDE starting before our end
        if i >= 0 and spans[i][1] > start:
            continue
        out.add((start, size))
    # two symbols at one start (aliases): the shorter, which claims fewer bytes
    firsts = {}
    for start, size in sorted(out):
        firsts.setdefault(start, size)
    return sorted(firsts.items())


def function_symbols(path: str, elf_cache=None) -> List[Tuple[int, int]]:
    """(start, size) of the file's function symbols, from the session's
    ElfCache (parsed once, shared with the symbolizer)."""
    from ..elffile import default_cache
    ef = (elf_cache or default_cache()).get(path, symbols=True)
    if ef is None:
        return []
    return [(s.value, s.size) for s in ef.function_symbols() if s.value]


def derived_rows(elf, fde_spans: Sequence[Tuple[int, int]],
                 syms: Optional[List[Tuple[int, int]]] = None, fast: bool = True) -> List[Row]:
    """Rows for every function of the ELF file (pyelftools ELFFile) that its
    symbols (syms: (start, size); None: read here) know and no FDE covers."""
    md = _capstone()
    if md is None:
        return []
    if syms is None:
        syms = []
        for name in (".symtab", ".dynsym"):
            sec = elf.get_section_by_name(name)
            if sec is None or not hasattr(sec, "iter_symbols"):
                continue
            for s in sec.iter_symbols():
                if s["st_info"]["type"] == "STT_FUNC" and s["st_value"] and s["st_shndx"] != "SHN_UNDEF":
                    syms.append((s["st_value"], s["st_size"]))
    funcs = uncovered_functions(syms, fde_spans)
    if not funcs:
        return []
    texts = [(sec["sh_addr"], sec["sh_addr"] + sec["sh_size"], sec) for sec in elf.iter_sections()
             if sec["sh_flags"] & 0x4 and sec["sh_type"] == "SHT_PROGBITS"]      # SHF_EXECINSTR
    data_of = {}
    rows: List[Row] = []
    for start, end, entries in _regions(funcs):
        sec = next((t for t in texts if t[0] <= start and end <= t[1]), None)
        if sec is None:
            continue
        lo, _, s = sec
        if lo not in data_of:
            data_of[lo] = s.data()
        code = data_of[lo][start - lo:end - lo]
        rows.extend(function_rows(code, start, md, entries, fast))
    return rows


def _regions(funcs: List[Tuple[int, int]]) -> List[Tuple[int, int, List[int]]]:
    """(start, end, entries) of the functions, those that overlap (a second
    entry symbol inside another's code) analysed as one region entered at
    each of their starts: where a path from one entry meets another with
    another rule, there is no row."""
    out: List[Tuple[int, int, List[int]]] = []
    for start, size in funcs:
        if out and start < out[-1][1]:
            s0, e0, entries = out[-1]
            out[-1] = (s0, max(e0, start + size), entries + [start])
        else:
            out.append((start, start + size, [start]))
    return out
