"""Unwind rows for functions no FDE covers, from their prologues.

Hand-written assembly (BLAS and GEMM kernels, vectorised math) often ships
without CFI, so .eh_frame has nothing for it and every stack stops there.
For each function the symbol tables know (.symtab, .dynsym: start and size)
that no FDE touches, its instructions are decoded (capstone) and the
prologue followed:

- `push REG`, `sub $N, %rsp`, `lea -N(%rsp), %rsp` move the CFA (rsp + 8 at
  entry) by what they take from the stack; `push %rbp` records where the
  caller's rbp is;
- `mov %rsp, %rbp` after `push %rbp` sets a frame pointer: from there on
  the rows are rbp-based (CFA = rbp + 16), which survive a stack realignment
  (`and $-32, %rsp`) and pushes in the body;
- anything else ends the prologue.

The body keeps the last prologue rule along the straight line from the
prologue, up to the first instruction that breaks it: one that writes rsp
(a push, pop, add, sub, and, leave, ret...; a call gives back what it
takes) for an rsp-based rule, one that writes rbp for an rbp-based one, or
an unconditional jump (what follows may be reached at another depth;
conditional jumps inside the function keep the depth).  From that instruction to the
function's end there is no row: the walk stops there, it never guesses.
The rows are marked UR_DERIVED, so the unwinder can count the frames that
needed them.
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Tuple

from .. import bpfdefs

UR_DERIVED = bpfdefs.value("UR_DERIVED")
UR_RSP, UR_RBP, UR_INVALID = (bpfdefs.value(n) for n in ("UR_RSP", "UR_RBP", "UR_INVALID"))
MAX_FUNCTION_BYTES = 1 << 20        # longer "functions" are not decoded (a symbol's size gone wrong)
PROLOGUE_MAX = 24                   # instructions looked at for a prologue

# one derived row: (address, (kind, cfa_off, rbp))
Row = Tuple[int, Tuple[int, int, int]]


def _capstone():
    try:
        import capstone
    except ImportError:
        return None
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    md.detail = True
    return md


def available() -> bool:
    return _capstone() is not None


def function_rows(code: bytes, start: int, md=None) -> List[Row]:
    """The rows of one function (its bytes at `start`), ending with an
    invalid row where its rule stops holding; [] when nothing can be said."""
    import capstone.x86 as X
    md = md or _capstone()
    if md is None:
        return []
    RSP, RBP = X.X86_REG_RSP, X.X86_REG_RBP
    rows: List[Row] = [(start, (UR_RSP | UR_DERIVED, 8, 0))]
    cfa, rbp_at, framed = 8, 0, False
    insns = md.disasm(code, start)
    n = 0
    body_from = None
    decoded_to = start
    for ins in insns:
        n += 1
        decoded_to = ins.address + ins.size
        m = ins.mnemonic
        ops = ins.operands
        nxt = ins.address + ins.size
        if n <= PROLOGUE_MAX and body_from is None:
            if m in ("endbr64", "nop"):
                continue
            if m == "push" and len(ops) == 1 and ops[0].type == X.X86_OP_REG and not framed:
                cfa += 8
                if ops[0].reg == RBP and rbp_at == 0:
                    rbp_at = -cfa
                rows.append((nxt, (UR_RSP | UR_DERIVED, cfa, rbp_at // 8)))
                continue
            if (m == "sub" and len(ops) == 2 and ops[0].type == X.X86_OP_REG and ops[0].reg == RSP
                    and ops[1].type == X.X86_OP_IMM and not framed):
                cfa += ops[1].imm
                rows.append((nxt, (UR_RSP | UR_DERIVED, cfa, rbp_at // 8)))
                continue
            if (m == "lea" and len(ops) == 2 and ops[0].type == X.X86_OP_REG and ops[0].reg == RSP
                    and ops[1].type == X.X86_OP_MEM and ops[1].mem.base == RSP
                    and ops[1].mem.index == 0 and not framed):
                cfa -= ops[1].mem.disp
                rows.append((nxt, (UR_RSP | UR_DERIVED, cfa, rbp_at // 8)))
                continue
            if (m == "mov" and len(ops) == 2 and ops[0].type == X.X86_OP_REG and ops[0].reg == RBP
                    and ops[1].type == X.X86_OP_REG and ops[1].reg == RSP and rbp_at == -cfa):
                # rbp = the address of the saved rbp: CFA = rbp + cfa
                framed = True
                rows.append((nxt, (UR_RBP | UR_DERIVED, cfa, rbp_at // 8)))
                continue
            body_from = ins.address
        if body_from is None:
            body_from = ins.address
        if cfa < 8 or cfa >= 32768:
            return []                       # not a frame this table can say
        # the body: the rule holds until an instruction breaks it
        _, written = ins.regs_access()
        if m.startswith("call"):
            continue                        # gives back what it takes
        # an unconditional jump ends the straight line from the prologue: what
        # follows it may be reached with another stack depth; a jump out of
        # the function is a tail call (its frame is gone)
        ends = (m in ("ret", "leave", "iretq", "jmp", "ljmp")
                or m.startswith("j") and _leaves(ins, start, len(code)))
        if ends or (RBP in written if framed else RSP in written):
            return _stop(rows, ins.address)
    # the end, or the first bytes capstone could not decode: nothing after
    return _stop(rows, decoded_to)


def _stop(rows: List[Row], at: int) -> List[Row]:
    """No row from `at` on (a rule that would start there covers nothing)."""
    while rows and rows[-1][0] >= at:
        rows.pop()
    rows.append((at, (UR_INVALID | UR_DERIVED, 0, 0)))
    return rows


def _leaves(ins, start: int, size: int) -> bool:
    """A jump out of the function (a tail call) or through a register."""
    import capstone.x86 as X
    ops = ins.operands
    if len(ops) != 1 or ops[0].type != X.X86_OP_IMM:
        return True
    return not start <= ops[0].imm < start + size


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
