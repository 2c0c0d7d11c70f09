"""Unwind rows for functions no FDE covers, from their own instructions:
the reference of the compiled helper's helper/prologue.c, rule for rule.

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

Code that neither a symbol nor an FDE covers (a stripped library's
assembly, as ONNX Runtime's MLAS kernels) lies in the gaps between known
code.  Its entries are not known, so it is entered where the library
refers to it: call and RIP-relative lea targets found by their bytes, and
the targets of its R_X86_64_RELATIVE relocations (function pointers).
Each such candidate is taken only if, followed on its own, every path
stays in the gap, decodes, reaches no conflict and no jump it cannot
follow, and every exit (ret, a jump out) it reaches is at the entry
depth (CFA = rsp + 8): gap_rows.
"""
from __future__ import annotations

import bisect
import os
from typing import Iterable, List, Optional, Sequence, Tuple

from pyoffcpu.kernel import bpfdefs
from pyoffcpu.native.elffile import section_bytes

MAX_CODE_SECTION_BYTES = 1 << 30        # code read for prologue analysis

UR_DERIVED = bpfdefs.value("UR_DERIVED")
UR_RSP, UR_RBP, UR_RBX, UR_INVALID = (bpfdefs.value(n) for n in ("UR_RSP", "UR_RBP", "UR_RBX", "UR_INVALID"))
RBP_LOST = bpfdefs.value("RBP_LOST")
MAX_FUNCTION_BYTES = 1 << 20        # longer "functions" are not decoded (a symbol's size gone wrong)
MAX_GAP_BYTES = 16 << 20            # longer gaps between known code are not decoded
MIN_GAP_BYTES = 16                  # shorter ones are padding
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


ENTRY: State = (UR_RSP, 8, 0)           # the rule at a function's entry
MAX_RUN = 64                            # instructions decoded at once (_Decoder)


class _Decoder:
    """The instruction at each address of the code, decoded on demand (the
    analysis decodes what control flow reaches: data between functions,
    which a linear sweep would take for code, is never looked at)."""

    def __init__(self, md, code: bytes, start: int):
        self.md, self.code, self.start = md, code, start
        self.insns: dict = {}           # address -> (size, mnemonic, operands)

    def at(self, addr: int):
        got = self.insns.get(addr)
        if got is None:
            off = addr - self.start
            if not 0 <= off < len(self.code):
                return None
            for a, size, m, ops in self.md.disasm_lite(self.code[off:off + 16 * MAX_RUN], addr, MAX_RUN):
                if a in self.insns:
                    break               # decoded from here before: the same instructions
                self.insns[a] = (size, m, ops)
            got = self.insns.get(addr)
        return got


class _Unknown(Exception):
    """The control flow cannot be followed: a jump through a register or
    memory, or to bytes that do not decode."""


def _traverse(dec: "_Decoder", start: int, end: int, entries: Sequence[int],
              fast: bool, follow: bool, prologue: set):
    """Follow the control flow from the entries (each with the rule ENTRY;
    so is every call target inside [start, end)).  Returns (rule
    before each instruction reached, the rules at the frame's exits: ret,
    a jump out).  Raises _Unknown (when following jumps) as its doc says."""
    state: dict = {}
    exits: List[State] = []
    work: List[int] = []

    def reach(addr: int, st: State):
        if dec.at(addr) is None:
            return                      # does not decode (or lies outside): no row
        old = state.get(addr)
        if old is None:
            state[addr] = st
        elif old != st and old != CONFLICT:
            state[addr] = CONFLICT
        else:
            return
        work.append(addr)

    for e in entries:
        reach(e, ENTRY)
    while work:
        a = work.pop()
        st = state[a]
        size, m, ops = dec.at(a)
        if fast and ops[:2] not in _MAYBE_FRAME_REG and m not in _SPECIAL and m[0] != "j" and \
                not m.startswith(_SPECIAL_PREFIXES) and a not in prologue:
            reach(a + size, st)         # most instructions: the rule goes on unchanged
            continue
        target = _int(ops.strip())
        if follow and m.startswith(("j", "loop")) and target is None:
            raise _Unknown("a jump through a register or memory")
        if m.startswith("call") and target is not None and start <= target < end and target != a + size:
            reach(target, ENTRY)        # a function of this code: entered as one
        if m.startswith("ret") or m == "jmp" and target is not None and not start <= target < end:
            exits.append(st)
        for nxt, nst in _successors(a, size, m, ops, st, start, end, follow, a in prologue):
            if start <= nxt < end:
                if nxt != a + size and dec.at(nxt) is None:
                    raise _Unknown("a jump to bytes that do not decode")
                reach(nxt, nst)
    return state, exits


def _prologue(dec: "_Decoder", entries: Sequence[int]) -> set:
    """The straight line after each entry, where stores into the frame count."""
    out = set()
    for e in entries:
        addr = e
        for _ in range(PROLOGUE_MAX):
            got = dec.at(addr)
            if got is None or got[1].startswith(("j", "call", "loop")) or got[1] in ENDS:
                break
            out.add(addr)
            addr += got[0]
    return out


def function_rows(code: bytes, start: int, md=None, entries: Optional[Sequence[int]] = None,
                  fast: bool = True) -> List[Row]:
    """The rows of the code at `start`: the rule before each instruction
    control flow reaches from the entries (default: `start`, a function's
    entry; more for symbols inside it, or the places a stripped library's
    code is entered), where the rule is ENTRY; calls to addresses inside
    the code are entries too.  UR_INVALID where the rule is not known.
    fast=False takes every instruction the slow way (the tests check both
    give the same rows).  Where the control flow cannot be followed (_Unknown)
    only the straight line from each entry is."""
    md = md or _capstone()
    if md is None:
        return []
    end = start + len(code)
    entries = [start] if entries is None else sorted(set(entries))
    dec = _Decoder(md, code, start)
    prologue = _prologue(dec, entries)
    try:
        state, _ = _traverse(dec, start, end, entries, fast, True, prologue)
    except _Unknown:
        state, _ = _traverse(dec, start, end, entries, fast, False, prologue)
    return _rows(state, dec, start)


def _rows(state: dict, dec: "_Decoder", start: int) -> List[Row]:
    """The table rows of an analysis: one where the rule changes, an invalid
    one over bytes no path reaches; none at all where two instructions
    reached overlap (not code the CPU runs this way)."""
    none = (UR_INVALID | UR_DERIVED, 0, 0)
    addrs = sorted(state)
    if any(x + dec.at(x)[0] > y for x, y in zip(addrs, addrs[1:])):
        return [(start, none)]
    rows: List[Row] = []
    after = start                       # where the last instruction reached ends
    for a in addrs:
        if a != after and (not rows or rows[-1][1] != none):
            rows.append((after, none))  # bytes no path reaches
        st = state[a]
        enc = none if st == CONFLICT else (st[0] | UR_DERIVED,) + st[1:]
        if not rows or rows[-1][1] != enc:
            rows.append((a, enc))
        after = a + dec.at(a)[0]
    if not rows or rows[-1][1] != none:
        rows.append((after, none))
    return rows


def gap_rows(code: bytes, start: int, candidates: Sequence[int], md=None, fast: bool = True) -> List[Row]:
    """The rows of a gap of known code (bytes at `start`) entered at the
    candidates that pass the entry check: followed from each on its own,
    every path stays within the gap and decodes, reaches no conflict and
    no jump it cannot follow, and every exit it reaches (ret, a jump out)
    has the return address at rsp (CFA = rsp + 8) with at least one exit.
    The depth at a candidate is then what it is at a function's entry,
    whatever the candidate is: the exits' depth proves it.  A candidate is
    an address the code calls or takes, so it is entered as a function is,
    with the caller's rbp still in rbp (the ABI keeps it there at a
    function's entry and exits)."""
    md = md or _capstone()
    if md is None:
        return []
    end = start + len(code)
    dec = _Decoder(md, code, start)
    good = []
    for e in sorted(set(candidates)):
        try:
            state, exits = _traverse(dec, start, end, [e], fast, True, _prologue(dec, [e]))
        except _Unknown:
            continue
        if (exits and CONFLICT not in state.values() and CONFLICT not in exits
                and all(x[0] == UR_RSP and x[1] == 8 for x in exits)
                and _stays_inside(state, dec, end)):
            good.append(e)
    if not good:
        return []
    try:
        state, _ = _traverse(dec, start, end, good, fast, True, _prologue(dec, good))
    except _Unknown:
        return []
    return _rows(state, dec, start)


def _stays_inside(state: dict, dec: "_Decoder", end: int) -> bool:
    """No instruction reached runs past the end of the gap, nor falls
    through into what follows it."""
    for a in state:
        size, m, _ = dec.at(a)
        if a + size > end or a + size == end and not (m in ENDS or m.startswith("ret")):
            return False
    return True


# The fast path of the analysis: an instruction whose first operand (its
# destination) does not start like rsp/rbp/rbx or one of their parts, and
# that is no stack, control or exchange instruction, keeps the rule (in the
# prologue, a store of rbp into the frame does not: the slow path).
_MAYBE_FRAME_REG = frozenset({"rs", "es", "sp", "rb", "eb", "bp", "bx", "bl", "bh"})
_SPECIAL = IMPLICIT_RSP | ENDS | RBX_IMPLICIT
_SPECIAL_PREFIXES = ("call", "loop", "iret", "push", "pop") + EXCHANGES


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
    from pyoffcpu.native.elfcache import default_cache
    ef = (elf_cache or default_cache()).get(path, symbols=True)
    if ef is None:
        return []
    return [(s.value, s.size) for s in ef.function_symbols() if s.value]


def derived_rows(elf, fde_spans: Sequence[Tuple[int, int]],
                 syms: Optional[List[Tuple[int, int]]] = None, fast: bool = True) -> List[Row]:
    """Rows for every function of the ELF file (pyelftools ELFFile) that its
    symbols (syms: (start, size); None: read here) know and no FDE covers,
    and for the code in the gaps neither covers (gap_rows)."""
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
    texts = [(sec["sh_addr"], sec["sh_addr"] + sec["sh_size"], sec) for sec in elf.iter_sections()
             if sec["sh_flags"] & 0x4 and sec["sh_type"] == "SHT_PROGBITS"]      # SHF_EXECINSTR
    regions = [(lo, hi, entries, False) for lo, hi, entries in _regions(funcs)]
    # code no symbol and no FDE covers (a stripped library's assembly): its
    # gaps, entered where the library refers to them (gap_rows checks each)
    known = sorted(list(fde_spans) + [(a, a + n) for a, n in syms if n > 0])
    gaps = [g for g in code_gaps([(t[0], t[1]) for t in texts], known) if g[1] - g[0] <= MAX_GAP_BYTES]
    if gaps:
        refs = sorted(set(function_pointers(elf)) | set(code_references(texts, gaps)))
        for lo, hi in gaps:
            i = bisect.bisect_left(refs, lo)
            j = bisect.bisect_left(refs, hi)
            if j > i:
                regions.append((lo, hi, refs[i:j], True))
    if not regions:
        return []
    data_of = {}
    rows: List[Row] = []
    for start, end, entries, gap in sorted(regions):
        sec = next((t for t in texts if t[0] <= start and end <= t[1]), None)
        if sec is None:
            continue
        lo, _, s = sec
        if lo not in data_of:
            data_of[lo] = section_bytes(s, MAX_CODE_SECTION_BYTES)
        code = data_of[lo][start - lo:end - lo]
        rows.extend(gap_rows(code, start, entries, md, fast) if gap else
                    function_rows(code, start, md, entries, fast))
    return rows


def code_gaps(sections: Sequence[Tuple[int, int]], known: Sequence[Tuple[int, int]]
              ) -> List[Tuple[int, int]]:
    """The ranges of the executable sections that no known range (FDE,
    function symbol) touches, of MIN_GAP_BYTES or more."""
    out = []
    for lo, hi in sections:
        cur = lo
        for a, b in known:
            if b <= cur or a >= hi:
                continue
            if a - cur >= MIN_GAP_BYTES:
                out.append((cur, a))
            cur = max(cur, b)
        if hi - cur >= MIN_GAP_BYTES:
            out.append((cur, hi))
    return out


def code_references(texts, gaps: Sequence[Tuple[int, int]]) -> List[int]:
    """Addresses inside the gaps that the code refers to: targets of
    `call rel32` and of `lea REG, [rip + disp32]` (how position-independent
    code takes a function's address, with no relocation), found by their
    bytes anywhere in the executable sections.  A match may be no
    instruction at all: gap_rows checks every address before it is taken."""
    import re
    import struct
    lo_g, hi_g = gaps[0][0], gaps[-1][1]
    starts = [g[0] for g in gaps]
    out = set()
    patterns = ((re.compile(rb"\xe8", re.S), 1, 5),
                (re.compile(rb"[\x48\x4c]\x8d[\x05\x0d\x15\x1d\x25\x2d\x35\x3d]", re.S), 3, 7))
    for base, _, sec in texts:
        data = section_bytes(sec, MAX_CODE_SECTION_BYTES)
        for pattern, at, size in patterns:
            for m in pattern.finditer(data):
                off = m.start()
                if off + size > len(data):
                    break
                target = base + off + size + struct.unpack_from("<i", data, off + at)[0]
                if lo_g <= target < hi_g:
                    i = bisect.bisect_right(starts, target) - 1
                    if i >= 0 and target < gaps[i][1]:
                        out.add(target)
    return sorted(out)


def function_pointers(elf) -> List[int]:
    """Sorted, the addresses R_X86_64_RELATIVE relocations put in the
    library's data: the pointers it keeps to its own code (dispatch tables
    of kernels chosen at run time, callbacks).  Read raw: a large C++
    library has millions of relocations."""
    import struct
    out = set()
    for sec in elf.iter_sections():
        if sec["sh_type"] != "SHT_RELA" or sec["sh_entsize"] != 24:
            continue
        for _, info, addend in struct.iter_unpack("<QQq", section_bytes(sec, MAX_CODE_SECTION_BYTES)):
            if info & 0xFFFFFFFF == 8:          # R_X86_64_RELATIVE
                out.add(addend)
    return sorted(out)


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
