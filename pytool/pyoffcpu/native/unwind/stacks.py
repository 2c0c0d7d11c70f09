"""The native stacks BPF walked (the nstacks map: hash -> pcs and flags),
read by user space at every drain: in a few batched syscalls where the
kernel has them (take_stacks), else one by one (stack, sweep).  A part of
NativeUnwinder (loader.py), on its state: _nstacks, _fresh, _batched,
stacks_read."""
from __future__ import annotations

import ctypes
import struct
from typing import List, Optional, Tuple

from ...kernel import bpfdefs
from ...kernel.bpfdefs import MAX_NATIVE_DEPTH


class WalkedStacks:
    """NativeUnwinder's reads of the stacks BPF walked."""

    def take_stacks(self, known) -> bool:
        """A drain's start: every stack in nstacks read and deleted in a few
        batched syscalls (not a lookup and a delete per new stack, and a
        walk of the map's keys to sweep it); those user space does not hold
        yet (`known`: their hashes) wait in _fresh for stack().  Time BPF
        adds later to a stack it stores later is in a later drain, with that
        stack.  False where the kernel has no batch ops (then stack() and
        sweep() do it one by one)."""
        if self._nstacks is None:
            return False
        leaf = self._nstacks.Leaf
        size = ctypes.sizeof(leaf)
        try:
            # a few hundred new stacks a drain, ~1 KiB each: small batches
            # (a 4096-entry buffer is 4 MiB to clear and copy every second)
            for kb, vb, n in self._nstacks.raw_lookup_batch(delete=True, chunk=256):
                for i, (h,) in enumerate(struct.iter_unpack("<Q", kb)):
                    if h not in known and h not in self._fresh:
                        self._fresh[h] = self._decode(leaf.from_buffer_copy(vb, i * size))
        except Exception:               # noqa: BLE001 - no batch ops: one by one
            self._batched = False
            return False
        self._batched = True
        return True

    @staticmethod
    def _decode(v) -> Tuple[List[int], int]:
        n = min(v.depth, MAX_NATIVE_DEPTH)
        return list(v.pcs[:n]), bpfdefs.with_methods(v.flags, list(v.methods))

    def sweep(self, known) -> int:
        """Delete the stacks of nstacks that user space already holds (BPF
        adds a stack again each time it walks it after user space took it):
        the map keeps only stacks not read yet.  Returns how many it deleted.
        After take_stacks, nothing: the map was emptied."""
        if self._nstacks is None or self._batched:
            return 0
        stale = [k for k in self._nstacks.keys() if k.value in known]
        for k in stale:
            try:
                del self._nstacks[k]
            except KeyError:
                pass
        return len(stale)

    def stack(self, h: int, delete: bool = True) -> Optional[Tuple[List[int], int]]:
        """(pcs innermost first, flags) of a walked stack; None if unknown
        (flags: NST_* and, from bit 32, the frames of each method)."""
        got = self._fresh.pop(h, None)
        if got is not None:
            self.stacks_read += 1
            return got
        k = self._nstacks.Key(h)
        try:
            v = self._nstacks[k]
        except KeyError:
            return None
        pcs, flags = self._decode(v)
        self.stacks_read += 1
        if delete:
            # user space keeps it from now on; BPF re-adds it if it sees it again
            try:
                del self._nstacks[k]
            except KeyError:
                pass
        return pcs, flags
