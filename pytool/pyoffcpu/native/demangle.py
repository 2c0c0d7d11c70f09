"""C++ names made readable in the process: ``__cxa_demangle`` from libstdc++
through ctypes, one name at a time, only for the names a profile shows.

The text is c++filt's (which users know from perf and gdb): libstdc++ and
binutils share libiberty's demangler, but ``__cxa_demangle`` does not ask
for its verbose form, which c++filt does; the one difference that makes is
how the standard abbreviations ``Ss``, ``Si``, ``So`` and ``Sd`` read
(``std::string`` against c++filt's ``std::basic_string<char,
std::char_traits<char>, std::allocator<char> >``), and ``_expand_standard``
writes those out as c++filt does (checked on libtorch_cpu.so's names:
tests/test_symbol_index.py).

libstdc++'s copy of the demangler is older than binutils' (GCC 12 against
binutils 2.40 on Debian 12): a few names it declines (lambdas with ``auto``
parameter packs, ``DpOT_``: 9 of 22,869 in that sample) c++filt reads.
Those few go to ``c++filt``, at most FALLBACK_RUNS runs per process (a
target cannot make pyoffcpu start thousands; most declined names are
malformed for c++filt too), then they stay as they are.

A name comes from the target's files: one over MAX_NAME bytes is shown as
it is (the demangler's work grows with the name), and nothing a name holds
can raise here.  Without libstdc++, ``c++filt`` does all the work in one run
per batch, as pyoffcpu did before.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import re
import shutil
import subprocess
from typing import Dict, Iterable, Optional, Tuple

__all__ = ["MAX_NAME", "available", "demangle", "demangle_all"]

MAX_NAME = 64 * 1024
FALLBACK_RUNS = 32          # c++filt runs for the names __cxa_demangle declines
CXXFILT_TIMEOUT_S = 10

_lib = None
_loaded = False


def _cxa_demangle():
    """libstdc++'s __cxa_demangle (and libc's free), None when they cannot
    be loaded."""
    global _lib, _loaded
    if not _loaded:
        _loaded = True
        try:
            std = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
            fn = std.__cxa_demangle
            fn.restype = ctypes.c_void_p
            fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.POINTER(ctypes.c_int)]
            libc = ctypes.CDLL(None)
            free = libc.free
            free.argtypes = [ctypes.c_void_p]
            free.restype = None
            _lib = (fn, free)
        except (OSError, AttributeError):
            _lib = None
    return _lib


def available() -> bool:
    """Names are demangled in the process (else by c++filt, if installed)."""
    return _cxa_demangle() is not None


# The standard substitutions whose verbose expansion (c++filt's) differs
# from the short one __cxa_demangle prints (libiberty cp-demangle.c,
# standard_subs).  libiberty itself prints the long form before a
# constructor or destructor name (`Ss` then C/D), so only the short form
# followed by something else needs writing out.
_STANDARD = {
    "std::string": "std::basic_string<char, std::char_traits<char>, std::allocator<char> >",
    "std::istream": "std::basic_istream<char, std::char_traits<char> >",
    "std::ostream": "std::basic_ostream<char, std::char_traits<char> >",
    "std::iostream": "std::basic_iostream<char, std::char_traits<char> >",
}
# one of them where it is a whole name: not inside another (mystd::string,
# a::std::string, std::string_view)
_STANDARD_RE = re.compile(r"(?<![\w:])(std::(?:string|istream|ostream|iostream))(?![\w])")
# the mangled forms that print them
_HAS_STANDARD = re.compile(r"S[siod]")


def _expand_standard(mangled: str, text: str) -> str:
    if "std::" not in text or not _HAS_STANDARD.search(mangled):
        return text
    return _STANDARD_RE.sub(lambda m: _STANDARD[m.group(1)], text)


_fallback_left = FALLBACK_RUNS
# what c++filt reads as one name: it splits its input into words of these
# (a name with anything else would come back as a word of it, demangled)
_WORD = re.compile(r"[A-Za-z0-9_.$]+")


def _one(mangled: str) -> Tuple[Optional[str], bool]:
    """(the readable form by __cxa_demangle, None when it cannot say;
    whether c++filt may: the name was declined, not refused for its size)."""
    lib = _cxa_demangle()
    if lib is None:
        return None, True
    fn, free = lib
    raw = mangled.encode("utf-8", "surrogateescape")
    if b"\0" in raw or len(raw) > MAX_NAME:
        return None, False
    status = ctypes.c_int(0)
    out = fn(raw, None, None, ctypes.byref(status))
    if not out:
        return None, status.value == -2         # -2: not a name it can read
    try:
        if status.value != 0:
            return None, False
        text = ctypes.string_at(out).decode("utf-8", "replace")
    finally:
        free(out)
    return _expand_standard(mangled, text), False


def _declined(names) -> Dict[str, str]:
    """c++filt's reading of names __cxa_demangle declined, while runs are
    left; {} else."""
    global _fallback_left
    # (_ZGV: the vector function ABI's names, which c++filt does not read either)
    todo = [n for n in names if not n.startswith("_ZGV")]
    if not todo or _fallback_left <= 0:
        return {}
    _fallback_left -= 1
    return {n: out for n, out in _with_cxxfilt(todo).items() if out != n}


def demangle(name: str) -> str:
    """The readable form of a ``_Z`` name; the name itself when it cannot be
    demangled (or is not a C++ name)."""
    return demangle_all([name]).get(name, name)


def demangle_all(names: Iterable[str]) -> Dict[str, str]:
    """{name: readable} for the ``_Z`` names among ``names`` (unchanged
    when they cannot be demangled)."""
    todo = sorted({n for n in names if isinstance(n, str) and n.startswith("_Z")})
    if not todo:
        return {}
    if _cxa_demangle() is None:
        return _with_cxxfilt(todo)
    out: Dict[str, str] = {}
    retry = []
    for n in todo:
        try:
            text, again = _one(n)
        except Exception:                       # noqa: BLE001 - a target's name never raises
            text, again = None, False
        out[n] = text or n
        if text is None and again:
            retry.append(n)
    if retry:
        out.update(_declined(retry))
    return out


def _with_cxxfilt(names) -> Dict[str, str]:
    """c++filt over names, in one run: the fallback without libstdc++."""
    todo = sorted({n for n in names if n.startswith("_Z") and len(n) <= MAX_NAME
                   and _WORD.fullmatch(n)})
    result = {n: n for n in names if isinstance(n, str) and n.startswith("_Z")}
    exe = shutil.which("c++filt")
    if not todo or exe is None:
        return result
    try:
        proc = subprocess.run([exe], input="\n".join(todo) + "\n", capture_output=True,
                              text=True, errors="surrogateescape", timeout=CXXFILT_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError, ValueError):
        return result
    lines = proc.stdout.split("\n")
    if proc.returncode == 0 and len(lines) >= len(todo):
        for name, out in zip(todo, lines):
            if out:
                result[name] = out
    return result
