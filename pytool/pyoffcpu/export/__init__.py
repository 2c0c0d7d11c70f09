"""Exporters: a Profile into a flame graph SVG, speedscope JSON or folded text.

`write_profile` renders and writes atomically: a temporary file in the
destination directory, fsync, then os.replace, so a reader never sees a
half-written profile and a failure leaves no stray file behind.
"""
from __future__ import annotations

import errno
import os
import tempfile
from typing import Optional

from ..profile import Profile

FORMATS = {"svg", "speedscope", "folded"}

_EXTENSIONS = {
    ".svg": "svg",
    ".json": "speedscope",
    ".folded": "folded",
    ".txt": "folded",
}

FILE_MODE = 0o644


def format_for_path(path: str) -> str:
    """The output format an output file name asks for, from its extension."""
    ext = os.path.splitext(os.fspath(path))[1].lower()
    fmt = _EXTENSIONS.get(ext)
    if fmt is None:
        known = ", ".join(f"{e} ({f})" for e, f in _EXTENSIONS.items())
        shown = f"extension {ext!r}" if ext else "no extension"
        raise ValueError(
            f"cannot tell the output format of {os.fspath(path)!r} from its name ({shown}); "
            f"use one of {known}, or give the format explicitly")
    return fmt


def render(profile: Profile, fmt: str, threads: bool = True, full_paths: bool = False,
           title: Optional[str] = None) -> str:
    """The profile rendered in format `fmt` (one of FORMATS) as text."""
    if fmt == "svg":
        from .svg import render_svg
        return render_svg(profile, threads=threads, full_paths=full_paths, title=title)
    if fmt == "speedscope":
        from .speedscope import render_speedscope
        return render_speedscope(profile, threads=threads, full_paths=full_paths)
    if fmt == "folded":
        from .folded import render_folded
        return render_folded(profile, threads=threads, full_paths=full_paths)
    raise ValueError(f"unknown output format {fmt!r}; known formats: {', '.join(sorted(FORMATS))}")


def _encode(text: str) -> bytes:
    try:
        # labels decoded with surrogateescape get their original bytes back
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace")


def _out_dir(path: str) -> str:
    return os.path.dirname(os.path.abspath(os.fspath(path)))


def check_writable(path: str) -> None:
    """Raise an OSError (FileNotFoundError, NotADirectoryError, PermissionError,
    IsADirectoryError, ...) with a clear message if `path` cannot be written:
    its directory must exist and accept a new file."""
    path = os.fspath(path)
    d = _out_dir(path)
    if not os.path.exists(d):
        raise FileNotFoundError(errno.ENOENT, f"output directory does not exist: {d}", path)
    if not os.path.isdir(d):
        raise NotADirectoryError(errno.ENOTDIR, f"output directory is not a directory: {d}", path)
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, f"output path is a directory: {path}", path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".pyoffcpu-check-", suffix=".tmp", dir=d)
    except OSError as e:
        raise type(e)(e.errno, f"cannot write to output directory {d}: {e.strerror}", path) from e
    os.close(fd)
    try:
        os.unlink(tmp)
    except OSError:
        pass


def write_bytes_atomic(path: str, data: bytes, mode: int = FILE_MODE) -> None:
    """Write `data` to `path` atomically (temp file in the same directory,
    fsync, os.replace); the temp file is removed on any error."""
    path = os.fspath(path)
    d = _out_dir(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=d)
    except OSError as e:
        raise type(e)(e.errno, f"cannot write {path}: {e.strerror}", path) from e
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    # make the rename itself durable; not all filesystems allow it
    try:
        dfd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def write_profile(profile: Profile, path: str, fmt: Optional[str] = None, threads: bool = True,
                  full_paths: bool = False, title: Optional[str] = None) -> None:
    """Render `profile` as `fmt` (None: from the extension of `path`) and write
    it to `path` atomically, mode 0644."""
    if fmt is None:
        fmt = format_for_path(path)
    if fmt not in FORMATS:
        raise ValueError(f"unknown output format {fmt!r}; known formats: {', '.join(sorted(FORMATS))}")
    text = render(profile, fmt, threads=threads, full_paths=full_paths, title=title)
    write_bytes_atomic(path, _encode(text))
