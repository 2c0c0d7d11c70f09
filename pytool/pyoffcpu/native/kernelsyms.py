"""Kernel symbols: the text symbols of /proc/kallsyms, sorted for bisection."""
from __future__ import annotations

import bisect
from typing import Iterable, Optional


# ---------------------------------------------------------------------------
class KernelSymbols:
    """Text symbols of /proc/kallsyms, sorted for bisection."""

    MAX_DISTANCE = 256 * 1024  # past this from the last symbol: unknown

    def __init__(self, entries: Iterable[tuple[int, str, Optional[str]]]):
        best: dict[int, tuple[str, Optional[str]]] = {}
        for addr, name, module in entries:
            if addr and addr not in best:
                best[addr] = (name, module)
        self._starts = sorted(best)
        self._names = [best[a][0] for a in self._starts]
        self._modules = [best[a][1] for a in self._starts]

    @classmethod
    def load(cls, path: str = "/proc/kallsyms") -> "KernelSymbols":
        entries = []
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3 or parts[1] not in "tTwW":
                    continue
                module = parts[3].strip("[]") if len(parts) > 3 else None
                entries.append((int(parts[0], 16), parts[2], module))
        return cls(entries)

    def __len__(self) -> int:
        return len(self._starts)

    def _index(self, addr: int) -> int:
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0 or addr - self._starts[i] > self.MAX_DISTANCE:
            return -1
        return i

    def resolve(self, addr: int) -> Optional[str]:
        i = self._index(addr)
        return self._names[i] if i >= 0 else None

    def module_of(self, addr: int) -> Optional[str]:
        i = self._index(addr)
        return self._modules[i] if i >= 0 else None

    def address_of(self, name: str) -> Optional[int]:
        for a, n in zip(self._starts, self._names):
            if n == name:
                return a
        return None
