"""The constants BPF and user space share, read from the BPF headers.

bpf/pyoffcpu.h, bpf/unwind_defs.h and bpf/crashes.h are the one source: every
`#define NAME value  /* comment */` there is read here, and so is every
`struct NAME { ... };`, as a ctypes type (struct_type), so Python never keeps
a second copy in step by hand.  The maps' key and value types come from the
compiled program; tests/test_bpf_cache.py checks that they are these.
"""
from __future__ import annotations

import ctypes
import os
import re
from typing import Dict, List, Optional, Tuple

# The BPF C: the package's bpf/, which in the source tree is a link to the
# tree's top-level bpf/ and in a wheel or the Debian package the files
# themselves (package data).
BPF_DIR = os.environ.get("PYOFFCPU_BPF_DIR") or os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bpf"))

_DEFINE = re.compile(r"^#define\s+([A-Z][A-Z0-9_]*)\s+(\(?-?(?:0x[0-9a-fA-F]+|\d+)\)?)(?:ULL|U|L)?\s*"
                     r"(?:/\*\s*(.*?)\s*(?:\*/)?)?$")


def read_defines(name: str) -> Dict[str, Tuple[int, str]]:
    """NAME -> (value, comment) of the plain integer #defines of bpf/<name>."""
    out: Dict[str, Tuple[int, str]] = {}
    with open(os.path.join(BPF_DIR, name)) as f:
        for line in f:
            m = _DEFINE.match(line.strip())
            if m:
                out[m.group(1)] = (int(m.group(2).strip("()"), 0), m.group(3) or "")
    return out


_DEFS: Dict[str, Tuple[int, str]] = {}
HEADERS = ("pyoffcpu.h", "unwind_defs.h", "crashes.h", "loadconst.h")   # crashes.h: the crash watcher's
for _h in HEADERS:
    _DEFS.update(read_defines(_h))


def value(name: str) -> int:
    return _DEFS[name][0]


def with_prefix(prefix: str) -> Dict[str, int]:
    """NAME (without the prefix) -> value, e.g. with_prefix("DROP_")."""
    return {k[len(prefix):]: v for k, (v, _) in _DEFS.items() if k.startswith(prefix)}


# Python stacks (bpf/pyoffcpu.h)
MAX_PY_DEPTH = value("MAX_PY_DEPTH")
PYF_ENTRY = value("PYF_ENTRY")
PYF_INTERP, PYF_OWN_GIL = value("PYF_INTERP"), value("PYF_OWN_GIL")   # a subinterpreter's mark
PYS_TRUNCATED = value("PYS_TRUNCATED")
PYS_READ_FAILED = value("PYS_READ_FAILED")
WALK_NONE = value("WALK_NONE")
CODE_STAMP_SPAN, NAME_STAMP_SPAN = value("CODE_STAMP_SPAN"), value("NAME_STAMP_SPAN")
CODE_STAMP_SEED, CODE_STAMP_PRIME = value("CODE_STAMP_SEED"), value("CODE_STAMP_PRIME")

# What the time is for
KIND_ONCPU = value("KIND_ONCPU")
KIND_SLEEP = value("KIND_SLEEP")
KIND_RUNQUEUE = value("KIND_RUNQUEUE")
KIND_UNINTERRUPTIBLE = value("KIND_UNINTERRUPTIBLE")
KIND_OTHER = value("KIND_OTHER")
SYS_SHIFT, SYS_OUTSIDE = value("SYS_SHIFT"), value("SYS_OUTSIDE")
# whether the thread held the GIL, above the system call
GIL_SHIFT = value("GIL_SHIFT")
GIL_UNKNOWN, GIL_FREE, GIL_HELD = value("GIL_UNKNOWN"), value("GIL_FREE"), value("GIL_HELD")
GIL_HELD_GC = value("GIL_HELD_GC")      # held, by a thread in the cyclic collector


def kind_gil(kind: int) -> int:
    """A key's GIL_* state."""
    return (kind >> GIL_SHIFT) & 3


def without_gil(kind: int) -> int:
    """A key's kind without its GIL bits: the state and the system call."""
    return kind & ~(3 << GIL_SHIFT)


def on_cpu(kind: int) -> bool:
    return without_gil(kind) == KIND_ONCPU

# Threads
TH = with_prefix("TH_")
# the kernel's fold of ended threads (control.fold, bpf: fold_exit)
FOLD_WALL, FOLD_OFFCPU, FOLD_SHADOW = value("FOLD_WALL"), value("FOLD_OFFCPU"), value("FOLD_SHADOW")
GROUP_TID = value("GROUP_TID")
LIFE_EXEC, LIFE_FORK, LIFE_EXIT = value("LIFE_EXEC"), value("LIFE_FORK"), value("LIFE_EXIT")
# waker_t.kind -> the word the profile keeps
WAKER_KINDS = {value("WAKER_NONE"): "unknown", value("WAKER_TASK"): "task",
               value("WAKER_TIMER"): "timer", value("WAKER_IRQ"): "irq"}
MAX_INLINE_TARGETS = value("MAX_INLINE_TARGETS")
TARGETS_IN_MAP = value("TARGETS_IN_MAP")

# Native stacks (bpf/unwind_defs.h)
MAX_NATIVE_DEPTH = value("MAX_NATIVE_DEPTH")
MAX_UNWIND_MAPS = value("MAX_UNWIND_MAPS")
NST_TRUNCATED = value("NST_TRUNCATED")
NST_INCOMPLETE = value("NST_INCOMPLETE")
NST_FRAMEPOINTER = value("NST_FRAMEPOINTER")
NST_UNMAPPED = value("NST_UNMAPPED")
NST_PROLOGUE = value("NST_PROLOGUE")
NST_PENDING = value("NST_PENDING")
UNWIND_FILE_PENDING = value("UNWIND_FILE_PENDING")
# native_stack.methods: frames found by each method, carried in the stack's
# flags from bit 32 on (one byte per method), as user space keeps them
METHOD_TABLE, METHOD_PROLOGUE, METHOD_FP = (value(n) for n in ("METHOD_TABLE", "METHOD_PROLOGUE", "METHOD_FP"))
METHOD_NAMES = {METHOD_TABLE: "cfi", METHOD_PROLOGUE: "prologue", METHOD_FP: "frame pointer"}
METHODS = value("METHODS")


def with_methods(flags: int, methods) -> int:
    """A stack's NST_* flags with its per-method frame counts (bytes) above."""
    return flags | int.from_bytes(bytes(methods[:METHODS]), "little") << 32


def frame_methods(flags: int) -> Dict[str, int]:
    """Method name -> frames it found, from with_methods' flags."""
    b = (flags >> 32).to_bytes(METHODS, "little")
    return {name: b[i] for i, name in METHOD_NAMES.items()}


def drop_names() -> Dict[int, str]:
    """Index in the drops arrays -> the name the summary prints (the
    header's comment up to its colon: `/* offcpu_start full: ... */`)."""
    out = {}
    for name, (idx, comment) in _DEFS.items():
        if name.startswith("DROP_"):
            out[idx] = (comment.split(":")[0].strip() or name[5:].lower().replace("_", " "))
    return out


N_DROPS = value("N_DROPS")


# -- structs ------------------------------------------------------------------------------
_SCALARS = {
    "unsigned long long": ctypes.c_uint64, "long long": ctypes.c_int64,
    "unsigned long": ctypes.c_uint64, "long": ctypes.c_int64,
    "unsigned int": ctypes.c_uint32, "int": ctypes.c_int32,
    "unsigned short": ctypes.c_uint16, "short": ctypes.c_int16,
    "unsigned char": ctypes.c_uint8, "signed char": ctypes.c_int8, "char": ctypes.c_char,
    "u64": ctypes.c_uint64, "s64": ctypes.c_int64, "u32": ctypes.c_uint32, "s32": ctypes.c_int32,
    "u16": ctypes.c_uint16, "s16": ctypes.c_int16, "u8": ctypes.c_uint8, "s8": ctypes.c_int8,
}
_STRUCT = re.compile(r"^struct\s+(\w+)\s*\{(.*?)^\};", re.S | re.M)
_FIELD = re.compile(r"^(struct\s+\w+|(?:unsigned\s+|signed\s+)?(?:long\s+long|long|int|short|char)|"
                    r"[us](?:8|16|32|64))\s+(.+)$")
_DECL = re.compile(r"^(\w+)(?:\[([\w +*-]+)\])?$")
_STRUCTS: Dict[str, type] = {}


def _strip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/", " ", text, flags=re.S)


def read_structs(name: str) -> List[Tuple[str, List[Tuple[str, str, Optional[str]]]]]:
    """The structs of bpf/<name>, in order: (struct name, [(type, field,
    array length or None)]).  Only what these headers use: scalar fields
    (several to a line), arrays of a number or a #define, nested structs."""
    with open(os.path.join(BPF_DIR, name)) as f:
        text = _strip_comments(f.read())
    out = []
    for m in _STRUCT.finditer(text):
        fields = []
        for decl in m.group(2).split(";"):
            decl = " ".join(decl.split())
            if not decl:
                continue
            fm = _FIELD.match(decl)
            if not fm:
                raise ValueError(f"bpf/{name}: struct {m.group(1)}: cannot read {decl!r}")
            for one in fm.group(2).split(","):
                dm = _DECL.match(one.strip())
                if not dm:
                    raise ValueError(f"bpf/{name}: struct {m.group(1)}: cannot read {one!r}")
                fields.append((fm.group(1), dm.group(1), dm.group(2)))
        out.append((m.group(1), fields))
    return out


def _length(expr: str) -> int:
    """An array length: numbers and #defines joined by + - * (no parentheses)."""
    terms = re.split(r"\s*([+*-])\s*", expr.strip())
    expr = "".join(t if t in "+-*" or t.isdigit() else str(value(t)) for t in terms)
    if not re.fullmatch(r"[0-9+*-]+", expr):
        raise ValueError(f"array length {expr!r}")
    return int(eval(expr, {"__builtins__": {}}))      # digits and + - * only


def struct_type(name: str) -> type:
    """The ctypes Structure of `struct name` in the BPF headers (natural
    alignment, as clang lays it out for BPF on x86-64)."""
    if not _STRUCTS:
        for h in HEADERS:
            for sname, fields in read_structs(h):
                cfields = []
                for ctype, fname, length in fields:
                    t = _STRUCTS[ctype.split()[1]] if ctype.startswith("struct ") else _SCALARS[ctype]
                    if length is not None:
                        t = t * _length(length)
                    cfields.append((fname, t))
                _STRUCTS[sname] = type(sname, (ctypes.Structure,), {"_fields_": cfields})
    return _STRUCTS[name]
