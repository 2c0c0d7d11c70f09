"""Reads another process's memory through /proc/PID/mem without stopping it."""
from __future__ import annotations

import os
import struct


class MemoryError_(OSError):
    pass


# pread's offset is a signed 64-bit off_t: an address at or above 2**63 (a
# kernel address, or a garbage pointer read from a torn structure) cannot even
# be asked for, and the kernel refuses a negative offset.  User space on x86_64
# ends far below this.
ADDRESS_LIMIT = 1 << 63


def readable_range(addr: int, size: int) -> bool:
    """Whether [addr, addr + size) can be asked of /proc/PID/mem at all."""
    return 0 < addr and 0 <= size and addr + size <= ADDRESS_LIMIT


class WordReads:
    """u64, i64, u32, i32 over a class's read(addr, size) (little-endian):
    a live process's memory, a core's, a crash capture's."""
    snapshot = False    # True: memory that does not change (a core, a capture)

    def read(self, addr: int, size: int) -> bytes:
        raise NotImplementedError

    def u64(self, addr: int) -> int:
        return struct.unpack("<Q", self.read(addr, 8))[0]

    def i64(self, addr: int) -> int:
        return struct.unpack("<q", self.read(addr, 8))[0]

    def u32(self, addr: int) -> int:
        return struct.unpack("<I", self.read(addr, 4))[0]

    def i32(self, addr: int) -> int:
        return struct.unpack("<i", self.read(addr, 4))[0]


class ProcessMemory(WordReads):
    def __init__(self, pid: int):
        self.pid = pid
        self._fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)

    def read(self, addr: int, size: int) -> bytes:
        if not readable_range(addr, size):
            raise MemoryError_(f"bad read of {size} at {addr:#x}")
        try:
            data = os.pread(self._fd, size, addr)
        except OSError as e:
            raise MemoryError_(f"read {size} at {addr:#x}: {e.strerror}") from None
        except (OverflowError, MemoryError):
            # a size no buffer can hold (a garbage length): a failed read, too
            raise MemoryError_(f"read {size} at {addr:#x}: too large") from None
        if len(data) != size:
            raise MemoryError_(f"short read at {addr:#x}")
        return data

    def read_upto(self, addr: int, size: int) -> bytes:
        """Up to size bytes at addr: fewer where the mapping ends first, b""
        where nothing is readable (one read where a header and what follows
        it would take several; the caller checks the length it needs)."""
        if not readable_range(addr, size):
            return b""
        try:
            return os.pread(self._fd, size, addr)
        except (OSError, OverflowError, MemoryError):
            return b""

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
