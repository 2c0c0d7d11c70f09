"""Separate debug files: where one for an ELF file may be (by build-id and
by .gnu_debuglink, in the target's root first, then ours), and the first
that fits (a .symtab and the same build-id).  The debuglink is a name the
file gives: only a plain file name is looked up (safe_debuglink)."""
from __future__ import annotations

import os
from typing import Optional, Sequence

from .elfcache import ElfCache, default_cache
from .elffile import FUNC_TYPES as _FUNC_TYPES, ElfFile
from .procmaps import _under_root, path_in_root

DEFAULT_DEBUG_DIRS = ("/usr/lib/debug",)
# Colon-separated directories searched for separate debug files instead of
# DEFAULT_DEBUG_DIRS (each by build-id, ``D/.build-id/ab/cdef....debug``, and
# by debuglink, ``D/<dir of the file>/<link>``); set but empty: none.
DEBUG_DIRS_ENV = "PYOFFCPU_DEBUG_DIRS"


def debug_dirs_from_env(environ=None) -> tuple[str, ...]:
    """The debug directories: $PYOFFCPU_DEBUG_DIRS, else DEFAULT_DEBUG_DIRS.

    Only absolute paths count (a relative one would depend on the current
    directory of whoever runs the symbolizer); a missing directory simply
    holds nothing."""
    env = os.environ if environ is None else environ
    raw = env.get(DEBUG_DIRS_ENV)
    if raw is None:
        return DEFAULT_DEBUG_DIRS
    return tuple(d.rstrip("/") or "/" for d in raw.split(":")
                 if d.startswith("/"))


def build_id_debug_path(build_id: str, debug_dir: str = DEFAULT_DEBUG_DIRS[0]
                        ) -> Optional[str]:
    """Where a debug file is looked up by GNU build-id:
    ``<debug_dir>/.build-id/<first byte>/<the rest>.debug``."""
    if not build_id or len(build_id) <= 2:
        return None
    return os.path.join(debug_dir, ".build-id", build_id[:2],
                        build_id[2:] + ".debug")


def safe_debuglink(link: Optional[str]) -> bool:
    """Is a .gnu_debuglink name one to look up?  The file names it: only a
    plain file name is (no directory, no `..`, no control character), so
    it can name nothing outside the debug directories it is joined to (an
    absolute path or `../` would have made root open any path, a FIFO or a
    device, outside the target's root too)."""
    return bool(link) and "/" not in link and link not in (".", "..") and \
        not any(ord(c) < 32 or c == "\x7f" for c in link)


def _debug_candidates(path: str, image: ElfFile,
                      debug_dirs: Sequence[str],
                      orig_path: Optional[str] = None,
                      root: Optional[str] = None) -> list[str]:
    """Where a separate debug file for ``path`` may live, best first.

    ``orig_path`` is the file's name in its process; ``root`` the process's
    own root directory as we reach it (``/proc/PID/root``, or any directory
    standing for it) when that is not ours: everything is looked up there
    first (a container ships its own /usr/lib/debug), then on the host."""
    out: list[str] = []
    roots = [root, None] if root and os.path.normpath(root) != "/" else [None]
    for r in roots:
        logical = path_in_root(orig_path or path, r)
        bid = image.build_id
        for d in debug_dirs:
            cand = build_id_debug_path(bid, d) if bid else None
            if cand:
                out.append(_under_root(r, cand))
        link = image.debuglink
        if not safe_debuglink(link):
            continue
        if r is None:
            dirs = [os.path.dirname(path)]
            if orig_path and os.path.dirname(orig_path) not in dirs:
                dirs.append(os.path.dirname(orig_path))
        else:
            dirs = [_under_root(r, os.path.dirname(logical))]
        for d in dirs:
            out.append(os.path.join(d, link))
            out.append(os.path.join(d, ".debug", link))
        logical_dir = os.path.dirname(logical)
        for d in debug_dirs:
            out.append(_under_root(r, os.path.join(d, logical_dir.lstrip("/"), link)))
    seen: set[str] = set()
    return [c for c in out if not (c in seen or seen.add(c))]


def _load_debug_image(path: str, image: ElfFile, debug_dirs: Sequence[str],
                      orig_path: Optional[str] = None,
                      want_types: frozenset = _FUNC_TYPES,
                      root: Optional[str] = None,
                      cache: Optional[ElfCache] = None,
                      symbols: bool = True,
                      ) -> tuple[Optional[str], Optional[ElfFile]]:
    """The first candidate debug file (see ``_debug_candidates``) that has a
    ``.symtab`` and, where both have one, the same build-id.  ``symbols``:
    with its symbol tables decoded (False: headers only, for the function
    index, which the helper reads from the file)."""
    cache = cache if cache is not None else default_cache()
    try:
        own = os.stat(path)
    except OSError:
        own = None

    def fits(dbg: ElfFile) -> bool:
        return dbg.has_symtab and not dbg.symbols_failed and not (
            image.build_id and dbg.build_id and dbg.build_id != image.build_id)

    for cand in _debug_candidates(path, image, debug_dirs, orig_path, root):
        try:
            st = os.stat(cand)
        except OSError:
            continue
        if own is not None and (st.st_dev, st.st_ino) == (own.st_dev,
                                                          own.st_ino):
            continue  # the debuglink names the file itself
        dbg = cache.get(cand, symbols=fits if symbols else False)
        if dbg is None or not fits(dbg):
            continue
        return cand, dbg
    return None, None
