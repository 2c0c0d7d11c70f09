"""Unwind rows for functions no FDE covers, from their prologues.

Hand-written assembly (BLAS and GEMM kernels, vectorised math) often ships
without CFI, so .eh_frame has nothing for it and every stack stops there.
For each function the symbol tables know (.symtab, .dynsym: start and size)
that no FDE touches, its instructions are decoded (capstone) and the
prologue followed:

- `push REG`, `sub $N, %rsp`, `lea -N(%rsp), %rsp` move the CFA (rsp + 8 at
  entry) by what they take from the stack; `push %rbp` records where the
  caller's rbp is;
- `mov REG, X(%rsp)` keeps a callee-saved register in the frame (for rbp:
  where the caller's rbp is);
- `mov %rsp, %rbp` after `push %rbp` sets a frame pointer: from there on
  the rows are rbp-based (CFA = rbp + 16), which survive a stack realignment
  (`and $-32, %rsp`) and pushes in the body;
- anything else ends the prologue.

The body keeps the last prologue rule along the straight line from the
prologue, up to the first instruction that breaks it: one that writes rsp
(a push, pop, add, sub, and, leave, ret...; a call gives back what it
takes) for an rsp-based rule, one that writes rbp for an rbp-based one, or
an unconditional jump (what follows may be reached at another depth;
conditional jumps inside the function keep the depth).  A body that writes
rbp when the caller's rbp was kept nowhere makes it unknown from there on
(RBP_LOST): a caller whose CFA is rbp-based then ends the walk.  From that instruction to the
function's end there is no row: the walk stops there, it never guesses.
The rows are marked UR_DERIVED, so the unwinder can count the frames that
needed them.  Decoding is capstone's text-only mode (ten times faster than
its detail mode); what an instruction writes is read from its text, and a
doubt stops the rule.
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Tuple

from .. import bpfdefs

UR_DERIVED = bpfdefs.value("UR_DERIVED")
UR_RSP, UR_RBP, UR_INVALID = (bpfdefs.value(n) for n in ("UR_RSP", "UR_RBP", "UR_INVALID"))
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


# Instructions that move rsp without naming it as their destination (a call
# gives back what it takes: it keeps the caller's depth).
IMPLICIT_RSP = frozenset({"push", "pushfq", "pushf", "pop", "popfq", "popf", "leave", "enter",
                          "ret", "retf", "iretq", "iret", "iretd"})
EXCHANGES = ("xchg", "xadd", "cmpxchg")
RSP_NAMES = frozenset({"rsp", "esp", "sp", "spl"})
RBP_NAMES = frozenset({"rbp", "ebp", "bp", "bpl"})
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


def function_rows(code: bytes, start: int, md=None) -> List[Row]:
    """The rows of one function (its bytes at `start`), ending with an
    invalid row where its rule stops holding; [] when nothing can be said."""
    md = md or _capstone()
    if md is None:
        return []
    rows: List[Row] = [(start, (UR_RSP | UR_DERIVED, 8, 0))]
    cfa, rbp_at, framed = 8, 0, False
    in_prologue = True
    n = 0
    decoded_to = start
    end = start + len(code)
    for addr, size, m, ops in md.disasm_lite(code, start):
        n += 1
        decoded_to = addr + size        # where the rule of a prologue step starts
        if in_prologue and n <= PROLOGUE_MAX:
            moved = None                # the CFA offset after this step, if it moves it
            if m in ("endbr64", "nop"):
                continue
            if m == "push" and ops in GPRS:
                moved = cfa + 8
                if ops == "rbp" and rbp_at == 0:
                    rbp_at = -moved
            elif m == "sub" and ops.startswith("rsp, "):
                imm = _int(ops[5:].strip())
                moved = None if imm is None else cfa + imm
            elif m == "lea" and ops.startswith("rsp, [rsp"):
                rest = ops[len("rsp, [rsp"):].strip()
                disp = 0 if rest == "]" else _int(rest[:-1].replace(" ", "")) if rest.endswith("]") else None
                moved = None if disp is None else cfa - disp
            elif m == "mov" and ops == "rbp, rsp" and rbp_at == -cfa:
                # rbp = the address of the saved rbp: CFA = rbp + cfa from here
                # on, whatever rsp does; the prologue has nothing more to say
                framed, in_prologue = True, False
                rows.append((decoded_to, (UR_RBP | UR_DERIVED, cfa, rbp_at // 8)))
                continue
            else:
                store = _frame_store(m, ops, cfa)
                if store is not None:
                    # `mov qword ptr [rsp + X], REG`: a callee-saved register kept
                    # in the frame (as hand-written kernels do instead of pushes)
                    if store[0] == "rbp" and rbp_at == 0:
                        rbp_at = store[1] - cfa
                        rows.append((decoded_to, (UR_RSP | UR_DERIVED, cfa, rbp_at // 8)))
                    continue
            if moved is not None:
                cfa = moved
                rows.append((decoded_to, (UR_RSP | UR_DERIVED, cfa, rbp_at // 8)))
                continue
        in_prologue = False
        if cfa < 8 or cfa >= 32768:
            return []                   # not a frame this table can say
        if m.startswith("call"):
            continue                    # gives back what it takes
        # an unconditional jump ends the straight line from the prologue: what
        # follows it may be reached with another stack depth; a jump out of
        # the function is a tail call (its frame is gone)
        if m in ENDS or m.startswith("j") and not _inside(ops, start, end):
            return _stop(rows, addr)
        if framed:
            if m == "pop" and ops in RBP_NAMES or _writes(m, ops, RBP_NAMES):
                return _stop(rows, addr)
            continue
        if m in IMPLICIT_RSP or _writes(m, ops, RSP_NAMES):
            return _stop(rows, addr)
        if rbp_at == 0 and rows[-1][1][2] != RBP_LOST and _writes(m, ops, RBP_NAMES):
            # the body takes rbp for itself and the caller's was kept nowhere:
            # from here on the caller's rbp is not known (a caller whose CFA is
            # rbp-based then ends the walk, instead of being walked from garbage)
            kind, off, _ = rows[-1][1]
            if rows[-1][0] == addr:
                rows.pop()              # a rule that would start here covers nothing
            rows.append((addr, (kind, off, RBP_LOST)))
    # the end, or the first bytes capstone could not decode: nothing after
    return _stop(rows, decoded_to)


def _frame_store(m: str, ops: str, cfa: int) -> Optional[Tuple[str, int]]:
    """(REG, X) for `mov qword ptr [rsp + X], REG` inside the frame."""
    if m != "mov" or not ops.startswith("qword ptr [rsp"):
        return None
    where, _, reg = ops.partition("], ")
    if reg not in GPRS:
        return None
    rest = where[len("qword ptr [rsp"):].replace(" ", "")
    x = 0 if rest == "" else _int(rest) if rest.startswith("+") else None
    if x is None or x < 0 or x % 8 or x + 8 > cfa - 8:
        return None                     # not a slot of this frame below the return address
    return reg, x


def _stop(rows: List[Row], at: int) -> List[Row]:
    """No row from `at` on (a rule that would start there covers nothing)."""
    while rows and rows[-1][0] >= at:
        rows.pop()
    rows.append((at, (UR_INVALID | UR_DERIVED, 0, 0)))
    return rows


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
                 syms: Optional[List[Tuple[int, int]]] = None) -> List[Row]:
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
    for start, size in funcs:
        sec = next((t for t in texts if t[0] <= start and start + size <= t[1]), None)
        if sec is None:
            continue
        lo, _, s = sec
        if lo not in data_of:
            data_of[lo] = s.data()
        code = data_of[lo][start - lo:start - lo + size]
        rows.extend(function_rows(code, start, md))
    return rows
