"""The user-space walker (unwind/walk.py, the BPF unwinder's rules) on real
processes blocked in a syscall: complete stacks through code built with and
without frame pointers, and through glibc."""
import os
import subprocess
import time

import pytest

from pyoffcpu.native import symbols
from pyoffcpu.native.unwind import loader, walk

CHAIN_C = r"""
#include <unistd.h>
#define KEEP __attribute__((noipa))
#define AFTER() __asm__ volatile("" ::: "memory")
static char buf[1];
KEEP long c_wait(long n) { long r = read(0, buf, 1); AFTER(); return r + n; }
KEEP long b_mid(long n) { volatile char pad[200]; pad[0] = n; long r = c_wait(n + pad[0]); AFTER(); return r; }
KEEP long a_top(long n) { long r = b_mid(n * 3); AFTER(); return r + 1; }
int main(int argc, char **argv) { return (int)a_top(argc); }
"""


@pytest.fixture(params=["-fomit-frame-pointer", "-fno-omit-frame-pointer"])
def blocked(request, tmp_path):
    src = tmp_path / "chain.c"
    src.write_text(CHAIN_C)
    exe = tmp_path / "chain"
    subprocess.run(["gcc", "-O2", request.param, "-o", str(exe), str(src)], check=True)
    r, w = os.pipe()
    proc = subprocess.Popen([str(exe)], stdin=r)
    proc.flavour = "nofp" if request.param == "-fomit-frame-pointer" else "fp"
    os.close(r)
    try:
        deadline = time.monotonic() + 10
        while walk.blocked_registers(proc.pid, proc.pid) is None:
            if time.monotonic() > deadline:
                pytest.skip("cannot read /proc/PID/syscall (ptrace access)")
            time.sleep(0.01)
        yield proc
    finally:
        os.close(w)
        proc.kill()
        proc.wait()


def names_of(pid, pcs):
    sym = symbols.Symbolizer()
    space = symbols.AddressSpace.of_process(pid)
    return [sym.resolve_user(pid, pc, space).name for pc in pcs]


def test_blocked_thread_walks_to_start(blocked, tmp_path):
    from pyoffcpu.native.unwind import table as T
    u = loader.NativeUnwinder(None, cache=T.TableCache(str(tmp_path / "cache")))
    assert u.update(blocked.pid, symbols.read_maps(blocked.pid))
    got = u.walk_blocked(blocked.pid, blocked.pid)
    assert got is not None
    pcs, flags = got
    names = names_of(blocked.pid, pcs)
    assert names[0] in ("read", "__libc_read", "__GI___libc_read"), names
    chain = [n for n in names if n in ("c_wait", "b_mid", "a_top", "main", "_start")]
    if blocked.flavour == "nofp":
        # complete: it ends at _start's undefined return address, every
        # caller frame found from CFI
        from pyoffcpu.kernel import bpfdefs
        assert flags & 0xFFFFFFFF == 0, flags
        assert bpfdefs.frame_methods(flags) == {"cfi": len(pcs) - 1, "prologue": 0, "frame pointer": 0}
        assert chain == ["c_wait", "b_mid", "a_top", "main", "_start"], names
    else:
        # /proc/PID/task/TID/syscall has no rbp: the first frame whose CFA is
        # rbp-based (c_wait, built with frame pointers) ends the walk there
        assert flags & walk.NST_INCOMPLETE and chain == ["c_wait"], (flags, names)


def test_walk_stops_cleanly_without_tables(blocked):
    u = loader.NativeUnwinder(None)
    # no update(): no tables for this process, nothing to walk
    assert u.walk_blocked(blocked.pid, blocked.pid) is None
    # a walk with no regions falls back to frame pointers and needs rbp
    regs = walk.blocked_registers(blocked.pid, blocked.pid)
    read = walk.memory_reader(blocked.pid)
    try:
        pcs, flags = walk.walk([], regs[0], regs[1], None, read)
    finally:
        read.close()
    assert pcs == [regs[0]] and flags & walk.NST_INCOMPLETE
