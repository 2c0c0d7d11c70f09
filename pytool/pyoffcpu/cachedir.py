"""Where pyoffcpu keeps what it computed once (unwind tables, BPF programs),
and the check that such a directory is safe to read from: what is read from
it steers BPF programs in the kernel."""
from __future__ import annotations

import hashlib
import os
from typing import Dict, Optional, Union


def cache_dir(kind: str) -> Optional[str]:
    """The directory for cache `kind`: PYOFFCPU_CACHE_DIR/kind, an empty
    PYOFFCPU_CACHE_DIR: None (caching off); else /var/cache/pyoffcpu/kind as
    root, ~/.cache/pyoffcpu/kind otherwise."""
    d = os.environ.get("PYOFFCPU_CACHE_DIR")
    if d == "":
        return None
    if d:
        return os.path.join(d, kind)
    if os.geteuid() == 0:
        return os.path.join("/var/cache/pyoffcpu", kind)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "pyoffcpu", kind)


def safe_dir(path: str) -> bool:
    """Made if missing (0700); True when it is ours and not writable by others."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
    except OSError:
        return False
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def write_private(path: str, data: Union[bytes, int]) -> bool:
    """Write a cache file atomically (a temp file beside it, mode 0600, then
    rename); False, with nothing left behind, when it cannot be written: a
    cache that cannot be written is only a slower next start.  data: the
    bytes, or an open file's descriptor whose whole content the kernel
    copies (a 70 MB symbol index never passes through our memory)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            if isinstance(data, int):
                size, off = os.fstat(data).st_size, 0
                while off < size:
                    n = os.sendfile(fd, data, off, size - off)
                    if n <= 0:
                        raise OSError("short copy")
                    off += n
            else:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False


_SHA256: Dict[tuple, str] = {}     # file_sha256's, by file identity


def file_sha256(path: str) -> str:
    """sha256 of a file's bytes, remembered in this process while its
    identity (device, inode, size, mtime) stays."""
    st = os.stat(path)
    ident = (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if ident not in _SHA256:
        with open(path, "rb") as f:
            _SHA256[ident] = hashlib.sha256(f.read()).hexdigest()
    return _SHA256[ident]
