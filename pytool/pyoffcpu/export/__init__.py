"""Exporters: a Profile into a flame graph SVG (svg), speedscope JSON
(speedscope), folded text (folded) or pprof (pprof: gzipped profile.proto),
and two profiles compared (diff).

`write_profile` renders and writes atomically: a temporary file in the
destination directory, fsync, then os.replace, so a reader never sees a
half-written profile and a failure leaves no stray file behind.
`write_profile_or_fallback` keeps a recording whose write fails in a file in
the temp directory.
"""
from __future__ import annotations

import errno
import os
import tempfile
from typing import Optional, Tuple, Union

from ..collect.platform import ProfilerError
from ..profile.model import Profile

FORMATS = {"svg", "speedscope", "folded", "pprof"}

_EXTENSIONS = {
    ".svg": "svg",
    ".json": "speedscope",
    ".folded": "folded",
    ".txt": "folded",
    ".pb.gz": "pprof",
    ".pprof": "pprof",
}

_FORMAT_EXTENSIONS = {"svg": ".svg", "speedscope": ".json", "folded": ".folded", "pprof": ".pb.gz"}


def _extension(path: str) -> str:
    """The name's extension as _EXTENSIONS knows it (.pb.gz is one)."""
    name = os.path.basename(os.fspath(path)).lower()
    if name.endswith(".pb.gz"):
        return ".pb.gz"
    return os.path.splitext(name)[1]

FILE_MODE = 0o644


def format_for_path(path: str) -> str:
    """The output format an output file name asks for, from its extension."""
    ext = _extension(path)
    fmt = _EXTENSIONS.get(ext)
    if fmt is None:
        known = ", ".join(f"{e} ({f})" for e, f in _EXTENSIONS.items())
        shown = f"extension {ext!r}" if ext else "no extension"
        raise ValueError(
            f"cannot tell the output format of {os.fspath(path)!r} from its name ({shown}); "
            f"use one of {known}, or give the format explicitly")
    return fmt


def render(profile: Profile, fmt: str, threads: bool = True, full_paths: bool = False,
           title: Optional[str] = None) -> Union[str, bytes]:
    """The profile rendered in format `fmt` (one of FORMATS): text, or bytes
    for pprof."""
    if fmt == "svg":
        from .svg import render_svg
        return render_svg(profile, threads=threads, full_paths=full_paths, title=title)
    if fmt == "speedscope":
        from .speedscope import render_speedscope
        return render_speedscope(profile, threads=threads, full_paths=full_paths)
    if fmt == "folded":
        from .folded import render_folded
        return render_folded(profile, threads=threads, full_paths=full_paths)
    if fmt == "pprof":
        from .pprof import render_pprof
        return render_pprof(profile, threads=threads, full_paths=full_paths)
    raise ValueError(f"unknown output format {fmt!r}; known formats: {', '.join(sorted(FORMATS))}")


def _encode(text: Union[str, bytes]) -> bytes:
    if isinstance(text, bytes):
        return text
    try:
        # labels decoded with surrogateescape get their original bytes back
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace")


def _out_dir(path: str) -> str:
    return os.path.dirname(os.path.abspath(os.fspath(path)))


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


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
    _unlink_quietly(tmp)


def _fill(fd: int, tmp: str, data: bytes, mode: int) -> None:
    """Write all of `data` to the new file `fd` (named `tmp`), fsync and close
    it; on any error the file is closed and removed and the error raised."""
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
    except BaseException:
        _unlink_quietly(tmp)
        raise


def write_bytes_atomic(path: str, data: bytes, mode: int = FILE_MODE) -> None:
    """Write `data` to `path` atomically (temp file in the same directory,
    fsync, os.replace); the temp file is removed on any error."""
    path = os.fspath(path)
    d = _out_dir(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=d)
    except OSError as e:
        raise type(e)(e.errno, f"cannot write {path}: {e.strerror}", path) from e
    _fill(fd, tmp, data, mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
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


def _rendered(profile: Profile, path: str, fmt: Optional[str], **kw) -> Tuple[str, bytes]:
    """(format, bytes) of `profile` as `fmt` (None: from the extension of `path`)."""
    if fmt is None:
        fmt = format_for_path(path)
    if fmt not in FORMATS:
        raise ValueError(f"unknown output format {fmt!r}; known formats: {', '.join(sorted(FORMATS))}")
    return fmt, _encode(render(profile, fmt, **kw))


def write_profile(profile: Profile, path: str, fmt: Optional[str] = None, threads: bool = True,
                  full_paths: bool = False, title: Optional[str] = None) -> None:
    """Render `profile` as `fmt` (None: from the extension of `path`) and write
    it to `path` atomically, mode 0644."""
    _, data = _rendered(profile, path, fmt, threads=threads, full_paths=full_paths, title=title)
    write_bytes_atomic(path, data)


def _reason(e: OSError) -> str:
    """The OS's words for an error, without the path our own wrappers add."""
    return os.strerror(e.errno) if e.errno else str(e)


def write_fallback(path: str, fmt: str, data: bytes, directory: str) -> str:
    """Write `data` to a new file in `directory` named after `path`
    (`pyoffcpu-fallback-<basename>.<random><ext>`); returns its path.  The
    file is removed again if the write fails."""
    base = os.path.basename(os.fspath(path)) or "profile"
    ext = _extension(base)
    if _EXTENSIONS.get(ext) != fmt:        # e.g. -o out.txt --format svg
        ext = _FORMAT_EXTENSIONS.get(fmt, "")
    fd, tmp = tempfile.mkstemp(prefix=f"pyoffcpu-fallback-{base}.", suffix=ext,
                               dir=directory)
    _fill(fd, tmp, data, FILE_MODE)
    return tmp


def write_profile_or_fallback(profile: Profile, path: str, fmt: Optional[str] = None,
                              threads: bool = True, full_paths: bool = False,
                              title: Optional[str] = None) -> None:
    """write_profile, but a write that fails (disk full, directory removed
    during the recording) does not lose the recording: the same bytes go to a
    fallback file in the temp directory, and a ProfilerError names both."""
    fmt, data = _rendered(profile, path, fmt, threads=threads, full_paths=full_paths, title=title)
    try:
        write_bytes_atomic(path, data)
        return
    except OSError as e:
        failed = f"cannot write {os.fspath(path)}: {_reason(e)}"
    tmpdir = None
    try:
        tmpdir = tempfile.gettempdir()      # raises when no temp directory is usable
        kept = write_fallback(path, fmt, data, tmpdir)
    except OSError as e:
        raise ProfilerError(f"{failed}; the fallback copy in {tmpdir or 'the temp directory'} "
                            f"failed too: {_reason(e)}",
                            "the profile is lost: free some space or choose another -o path") from None
    raise ProfilerError(failed, f"the profile was saved to {kept}")
