"""Reads another process's memory through /proc/PID/mem without stopping it."""
from __future__ import annotations

import os
import struct


class MemoryError_(OSError):
    pass


class ProcessMemory:
    def __init__(self, pid: int):
        self.pid = pid
        self._fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)

    def read(self, addr: int, size: int) -> bytes:
        if addr <= 0 or size < 0:
            raise MemoryError_(f"bad read at {addr:#x}")
        try:
            data = os.pread(self._fd, size, addr)
        except OSError as e:
            raise MemoryError_(f"read {size} at {addr:#x}: {e.strerror}") from None
        if len(data) != size:
            raise MemoryError_(f"short read at {addr:#x}")
        return data

    def u64(self, addr: int) -> int:
        return struct.unpack("<Q", self.read(addr, 8))[0]

    def i64(self, addr: int) -> int:
        return struct.unpack("<q", self.read(addr, 8))[0]

    def u32(self, addr: int) -> int:
        return struct.unpack("<I", self.read(addr, 4))[0]

    def i32(self, addr: int) -> int:
        return struct.unpack("<i", self.read(addr, 4))[0]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
