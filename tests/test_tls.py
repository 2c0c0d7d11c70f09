"""cpython/tls.py: where 3.15 keeps each thread's PyThreadState (the
thread-local _Py_tss_gilstate), read from the code of
PyGILState_GetThisThreadState as the three builds here have it, and checked
on the threads.  The byte strings are those of Debian's 3.15.0 builds
(objdump of python3.15, python3.15d and libpython3.15.so.1.0); the live
processes are in test_cpython_versions.py[debian-3.15*]."""

from pyoffcpu.cpython import tls
from pyoffcpu.kernel.memory import MemoryError_

ENDBR = bytes.fromhex("f30f1efa")
# python3.15: mov %fs:0xffffffffffffffd8,%rax ; ret
STATIC = ENDBR + bytes.fromhex("64488b0425d8ffffff") + b"\xc3"
# libpython3.15.so: push %rbp; mov %rsp,%rbp; lea 0x4a5231(%rip),%rdi;
# call __tls_get_addr@plt; pop %rbp; mov 0x28(%rax),%rax; ret
SHARED = ENDBR + bytes.fromhex("554889e5488d3d31524a00e80ce9cfff5d488b8028000000c3")
FUNC = 0x7000_0000_1000


class Mem:
    """A sparse address space of 8-byte words."""

    def __init__(self, code=b"", words=None):
        self.code, self.words = code, dict(words or {})

    def read(self, addr, n):
        if addr == FUNC:
            return self.code[:n].ljust(n, b"\0")
        raise MemoryError_("unmapped %#x" % addr)

    def u64(self, addr):
        if addr not in self.words:
            raise MemoryError_("unmapped %#x" % addr)
        return self.words[addr]


def test_local_exec_is_its_displacement():
    shape, why = tls.decode(STATIC, FUNC, None)
    assert shape.kind == "local-exec" and shape.distance == -0x28, why


def test_general_dynamic_goes_through_the_tls_index_and_the_dtv():
    ti = FUNC + 4 + 4 + 7 + 0x4a5231          # the lea's end plus its displacement
    tp, dtv, block = 0x7f00_0000_8000, 0x5500_0000_0000, 0x7f00_0000_7fd0
    ts = 0x5600_0000_1000
    mem = Mem(SHARED, {ti: 2, ti + 8: 0, tp + 8: dtv, dtv + 16 * 2: block, block + 0x28: ts})
    shape, _ = tls.decode(SHARED, FUNC, mem.u64)
    assert (shape.kind, shape.module, shape.offset) == ("general-dynamic", 2, 0x28)
    assert shape.distance_for(mem, tp) == block + 0x28 - tp == -8
    assert tls.gilstate_distance(mem, FUNC, [(ts, tp)]) == (-8, "")


def test_each_thread_must_hold_its_own_state_at_the_distance():
    t1, t2 = 0x7f00_0000_8000, 0x7f00_0010_8000
    s1, s2 = 0x5600_0000_1000, 0x5600_0000_2000
    ok = Mem(STATIC, {t1 - 0x28: s1, t2 - 0x28: s2})
    assert tls.gilstate_distance(ok, FUNC, [(s1, t1), (s2, t2)]) == (-0x28, "")
    # a thread that has not bound its state yet holds 0: fine, if another does
    unbound = Mem(STATIC, {t1 - 0x28: s1, t2 - 0x28: 0})
    assert tls.gilstate_distance(unbound, FUNC, [(s1, t1), (s2, t2)]) == (-0x28, "")
    # none bound yet: ask again later
    assert tls.gilstate_distance(Mem(STATIC, {t1 - 0x28: 0}), FUNC, [(s1, t1)]) == (None, "")
    # a thread in a sub-interpreter: its binding is its state there, also its own
    s1_sub = 0x5600_0000_3000
    sub = Mem(STATIC, {t1 - 0x28: s1_sub, t2 - 0x28: s2})
    assert tls.gilstate_distance(sub, FUNC, [(s1, t1), (s2, t2), (s1_sub, t1)]) == (-0x28, "")
    # another thread's state (or garbage) there: this is not the variable
    wrong = Mem(STATIC, {t1 - 0x28: s2, t2 - 0x28: s2})
    d, why = tls.gilstate_distance(wrong, FUNC, [(s1, t1), (s2, t2)])
    assert d is None and "not its thread state" in why


def test_code_of_another_shape_and_dynamic_tls_are_said():
    d, why = tls.gilstate_distance(Mem(ENDBR + b"\x31\xc0\xc3"), FUNC, [(1, 2)])
    assert d is None and "shape" in why
    ti = FUNC + 4 + 4 + 7 + 0x4a5231
    tp, dtv = 0x7f00_0000_8000, 0x5500_0000_0000
    # dlopen()ed: the module's block is not allocated in this thread yet
    mem = Mem(SHARED, {ti: 2, ti + 8: 0, tp + 8: dtv, dtv + 32: (1 << 64) - 1})
    d, why = tls.gilstate_distance(mem, FUNC, [(0x5600_0000_1000, tp)])
    assert d is None and "static TLS" in why
