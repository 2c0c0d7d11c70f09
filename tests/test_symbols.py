"""Tests for pyoffcpu.symbols against real, freshly built processes."""

import os
import random
import shutil
import subprocess
import time

import pytest

from pyoffcpu.native import symbols
from pyoffcpu.native.symbols import (AddressSpace, ElfSymbols, KernelSymbols, Mapping,
                                     NativeSymbol, Symbolizer, demangle, find_symbol_address,
                                     parse_maps, read_maps, runtime_address)

CFLAGS = ["-O2", "-fomit-frame-pointer"]

LIB_C = r"""
__attribute__((noinline, noclone)) static void *lib_here(void) {
    return __builtin_return_address(0);
}
__attribute__((noinline)) void *lib_work(int n) {
    volatile int s = 0;
    for (int i = 0; i < n; i++) s += i;
    void *r = lib_here();
    s += 1;
    return r;
}
"""

PLUGIN_CPP = r"""
namespace demo {
struct Widget { static void *spin(int n); };
__attribute__((noinline, noclone)) static void *plug_here() {
    return __builtin_return_address(0);
}
__attribute__((noinline)) void *Widget::spin(int n) {
    volatile int s = 0;
    for (int i = 0; i < n; i++) s += i;
    void *r = plug_here();
    s += 1;
    return r;
}
}
extern "C" void *plug_spin_addr(void) { return (void *)&demo::Widget::spin; }
extern "C" void *plug_spin_inner(int n) { return demo::Widget::spin(n); }
"""

APP_C = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <unistd.h>

void *lib_work(int n);

__attribute__((noinline, noclone)) static void *app_here(void) {
    return __builtin_return_address(0);
}
__attribute__((noinline)) void *app_work(int n) {
    volatile int s = 0;
    for (int i = 0; i < n; i++) s += i;
    void *r = app_here();
    s += 1;
    return r;
}
__attribute__((noinline, noclone)) static int app_static_helper(int x) {
    volatile int s = x;
    for (int i = 0; i < x; i++) s = s * 3 + i;
    return s;
}

int main(int argc, char **argv) {
    void *h = dlopen(argv[1], RTLD_NOW);
    if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    void *(*spin_addr)(void) = (void *(*)(void))dlsym(h, "plug_spin_addr");
    void *(*spin_inner)(int) = (void *(*)(int))dlsym(h, "plug_spin_inner");
    printf("app_work %p\n", (void *)app_work);
    printf("app_work+inner %p\n", app_work(10));
    printf("app_static_helper %p %d\n", (void *)app_static_helper,
           app_static_helper(3));
    printf("lib_work %p\n", dlsym(RTLD_DEFAULT, "lib_work"));
    printf("lib_work+inner %p\n", lib_work(10));
    printf("demo::Widget::spin(int) %p\n", spin_addr());
    printf("demo::Widget::spin(int)+inner %p\n", spin_inner(10));
    printf("READY\n");
    fflush(stdout);
    sleep(120);
    return 0;
}
"""

def _run(cmd, **kw):
    subprocess.run(cmd, check=True, capture_output=True, **kw)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not all(shutil.which(t) for t in ("gcc", "g++", "objcopy", "strip")):
        pytest.skip("needs gcc, g++ and binutils")
    d = tmp_path_factory.mktemp("native")
    (d / "lib.c").write_text(LIB_C)
    (d / "plugin.cpp").write_text(PLUGIN_CPP)
    (d / "app.c").write_text(APP_C)
    _run(["gcc", *CFLAGS, "-fPIC", "-shared", "-o", d / "libapp.so",
          d / "lib.c"])
    _run(["g++", *CFLAGS, "-fPIC", "-shared", "-o", d / "libplug.so",
          d / "plugin.cpp"])
    link = ["-L", str(d), "-lapp", f"-Wl,-rpath,{d}", "-ldl",
            "-Wl,--build-id"]
    _run(["gcc", *CFLAGS, "-g", "-fPIE", "-pie", "-o", d / "app_pie",
          d / "app.c", *link])
    _run(["gcc", *CFLAGS, "-fno-pie", "-no-pie", "-o", d / "app_nopie",
          d / "app.c", *link])
    # Stripped copy whose symbols live in a debug file found by build-id.
    dbg_root = d / "debug"
    _run(["objcopy", "--only-keep-debug", d / "app_pie", d / "app.debug"])
    shutil.copy(d / "app_pie", d / "app_stripped")
    _run(["strip", "--strip-all", d / "app_stripped"])
    build_id = ElfSymbols(str(d / "app_pie")).build_id
    assert build_id
    bid_dir = dbg_root / ".build-id" / build_id[:2]
    bid_dir.mkdir(parents=True)
    shutil.copy(d / "app.debug", bid_dir / (build_id[2:] + ".debug"))
    # Another stripped copy that finds its debug file via .gnu_debuglink.
    linkdir = d / "linked"
    (linkdir / ".debug").mkdir(parents=True)
    shutil.copy(d / "app.debug", linkdir / ".debug" / "app_linked.debug")
    shutil.copy(d / "app_stripped", linkdir / "app_linked")
    _run(["objcopy", f"--add-gnu-debuglink={linkdir / '.debug' / 'app_linked.debug'}",
          linkdir / "app_linked"])
    (d / "nodebug").mkdir()
    return d


class Proc:
    """A running test program and the addresses it printed."""

    def __init__(self, exe, plugin):
        self.popen = subprocess.Popen([str(exe), str(plugin)],
                                      stdout=subprocess.PIPE, text=True)
        self.addrs = {}
        for line in self.popen.stdout:
            if line.strip() == "READY":
                break
            name, addr = line.split()[:2]
            self.addrs[name] = int(addr, 16)
        else:
            raise RuntimeError(f"{exe} exited early")
        self.pid = self.popen.pid
        self.exe = str(exe)

    def stop(self):
        self.popen.kill()
        self.popen.wait()
        self.popen.stdout.close()


@pytest.fixture
def spawn(built):
    procs = []

    def start(name):
        p = Proc(built / name, built / "libplug.so")
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stop()


def expected_name(key):
    return key.split("+")[0]


def check_all_names(sym, proc, space):
    for key, addr in proc.addrs.items():
        want = expected_name(key)
        probes = [addr] if "+" in key else [addr, addr + 1, addr + 4]
        for a in probes:
            got = sym.frame_name(sym.resolve_user(proc.pid, a, space))
            assert got == want, (key, hex(a), got)


@pytest.mark.parametrize("exe", ["app_pie", "app_nopie"])
def test_resolve_pie_nopie_and_shared(spawn, exe):
    proc = spawn(exe)
    space = AddressSpace.of_process(proc.pid)
    sym = Symbolizer()
    check_all_names(sym, proc, space)
    r = sym.resolve_user(proc.pid, proc.addrs["app_work"], space)
    assert r.module.endswith("/" + exe) and r.name == "app_work"
    assert r.symbol_offset == 0
    inner = sym.resolve_user(proc.pid, proc.addrs["app_work+inner"], space)
    assert inner.symbol_offset > 0
    lib = sym.resolve_user(proc.pid, proc.addrs["lib_work"], space)
    assert lib.module.endswith("/libapp.so")
    # non-PIE: the ELF vaddr is the runtime address itself
    if exe == "app_nopie":
        assert r.offset == proc.addrs["app_work"]


def test_symbolize_after_exit(spawn):
    proc = spawn("app_pie")
    space = AddressSpace(proc.pid)
    space.add_snapshot(read_maps(proc.pid))
    proc.stop()
    assert not space.refresh()  # gone, the old snapshot stays
    sym = Symbolizer()
    check_all_names(sym, proc, space)


def test_cxx_demangled(spawn):
    proc = spawn("app_pie")
    sym = Symbolizer()
    r = sym.resolve_user(proc.pid, proc.addrs["demo::Widget::spin(int)"])
    assert r.name == "_ZN4demo6Widget4spinEi"
    assert sym.frame_name(r) == "demo::Widget::spin(int)"
    assert sym.frame_names([r, NativeSymbol("main", "/x", 0)]) == \
        ["demo::Widget::spin(int)", "main"]
    raw = Symbolizer(demangle_names=False)
    assert raw.frame_name(r) == "_ZN4demo6Widget4spinEi"


def test_demangle_without_cxxfilt(monkeypatch):
    """In the process (libstdc++) c++filt is not needed; without either,
    names stay as they are."""
    from pyoffcpu.native import demangle as D
    monkeypatch.setenv("PATH", "/nonexistent")
    assert demangle(["_ZN4demo6Widget4spinEi", "plain"]) == \
        {"_ZN4demo6Widget4spinEi": "demo::Widget::spin(int)"}
    monkeypatch.setattr(D, "_cxa_demangle", lambda: None)
    assert demangle(["_ZN4demo6Widget4spinEi", "plain"]) == \
        {"_ZN4demo6Widget4spinEi": "_ZN4demo6Widget4spinEi"}
    sym = Symbolizer()
    assert sym.frame_name(NativeSymbol("_ZN4demo6Widget4spinEi", "/m", 1)) \
        == "_ZN4demo6Widget4spinEi"


def test_stripped_with_build_id_debug_file(spawn, built):
    proc = spawn("app_stripped")
    space = AddressSpace.of_process(proc.pid)
    helper = proc.addrs["app_static_helper"]
    # Without the debug directory the local function has no symbol: only
    # its FDE names it (by its start, the function's first byte).
    bare = Symbolizer(debug_dirs=[str(built / "nodebug")])
    r = bare.resolve_user(proc.pid, helper, space)
    assert r.name is None and r.fde_start == r.offset, r
    assert bare.frame_name(r) == f"app_stripped@0x{r.offset:x}"
    sym = Symbolizer(debug_dirs=[str(built / "debug")])
    check_all_names(sym, proc, space)
    elf = sym.elf_for_path(str(built / "app_stripped"))
    assert elf.debug_file and elf.debug_file.startswith(str(built / "debug"))


def test_stripped_with_debuglink(built):
    p = Proc(built / "linked" / "app_linked", built / "libplug.so")
    try:
        sym = Symbolizer(debug_dirs=[str(built / "nodebug")])
        check_all_names(sym, p, AddressSpace.of_process(p.pid))
        elf = sym.elf_for_path(str(built / "linked" / "app_linked"))
        assert elf.debug_file.endswith("/.debug/app_linked.debug")
    finally:
        p.stop()


def test_unknown_addresses(spawn):
    proc = spawn("app_pie")
    space = AddressSpace.of_process(proc.pid)
    sym = Symbolizer()
    first = min((m for m in space.mappings if m.path == proc.exe),
                key=lambda m: m.start)
    # The ELF header at the start of the file holds no function.
    r = sym.resolve_user(proc.pid, first.start + 0x10, space)
    assert r.name is None
    assert sym.frame_name(r) == "[unknown] app_pie+0x10"
    # Nothing mapped at all.
    r = sym.resolve_user(proc.pid, 0x1000, space)
    assert (r.module, sym.frame_name(r)) == (None, "[unknown]")
    # Anonymous memory (heap/stack) has a mapping but no file.
    stack = next(m for m in space.mappings if m.path == "[stack]")
    assert sym.frame_name(sym.resolve_user(proc.pid, stack.start, space)) \
        .startswith("[unknown] [stack]+0x")


def test_vdso_symbols():
    sym = Symbolizer()
    space = AddressSpace.of_process(os.getpid())
    vdso = next((m for m in space.mappings if m.path == "[vdso]"), None)
    if vdso is None:
        pytest.skip("no vdso")
    names = {sym.frame_name(sym.resolve_user(os.getpid(), a, space))
             for a in range(vdso.start, vdso.end, 16)}
    assert any("clock_gettime" in n for n in names), names


def test_kernel_symbols():
    entries = {}
    with open("/proc/kallsyms") as f:
        for line in f:
            addr, kind, name = line.split()[:3]
            if kind in "tT" and int(addr, 16):
                entries.setdefault(name, int(addr, 16))
    if not entries:
        pytest.skip("kallsyms addresses hidden")
    sym = Symbolizer()
    for name in ("vfs_read", "schedule", "do_sys_openat2"):
        if name in entries:
            assert sym.resolve_kernel(entries[name]) == name
            assert sym.resolve_kernel(entries[name] + 1) == name
            assert sym.kernel_frame_name(entries[name] + 2) == name
    assert sym.resolve_kernel(16) is None
    assert sym.kernel_frame_name(16) == "[unknown]"
    ks = KernelSymbols([(0x1000, "a", None), (0x1100, "b", "mod")])
    assert ks.resolve(0x10ff) == "a" and ks.resolve(0x1100) == "b"
    assert ks.module_of(0x1101) == "mod" and ks.resolve(0xfff) is None


def test_parse_maps_and_merge():
    text = (
        "00400000-00452000 r-xp 00000000 08:02 173521 /usr/bin/dbus daemon\n"
        "7f0000000000-7f0000001000 r-xp 00002000 08:02 99 /tmp/x.so (deleted)\n"
        "7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]\n"
        "7ffe00000000-7ffe00001000 rw-p 00000000 00:00 0\n"
    )
    maps = parse_maps(text)
    assert maps[0] == Mapping(0x400000, 0x452000, 0, "r-xp",
                              "/usr/bin/dbus daemon", 173521)
    assert maps[1].deleted and maps[1].path == "/tmp/x.so"
    assert maps[1].offset == 0x2000 and maps[1].is_file
    assert maps[3].path == "" and not maps[3].is_file
    space = AddressSpace(None, maps)
    assert space.find(0x400000) is maps[0]
    assert space.find(0x451fff) is maps[0]
    assert space.find(0x452000) is None
    # A later snapshot replaces what it overlaps and keeps the rest.
    newer = Mapping(0x7f0000000000, 0x7f0000002000, 0, "r-xp", "/tmp/y.so", 7)
    space.add_snapshot([newer])
    assert space.find(0x7f0000000800) is newer
    assert space.find(0x400100) is maps[0]
    assert len(space) == 4


def test_performance_10k(spawn):
    proc = spawn("app_pie")
    space = AddressSpace.of_process(proc.pid)
    rng = random.Random(1)
    code = [m for m in space.mappings if "x" in m.perms and m.is_file]
    addrs = [rng.randrange(m.start, m.end) for m in code
             for _ in range(10_000 // len(code) + 1)][:10_000]
    addrs += list(proc.addrs.values())
    sym = Symbolizer()
    for m in code:  # load every file once
        sym.resolve_user(proc.pid, m.start, space)
    t0 = time.perf_counter()
    names = sym.frame_names(sym.resolve_user(proc.pid, a, space)
                            for a in addrs)
    elapsed = time.perf_counter() - t0
    assert len(names) == len(addrs)
    assert "app_work" in names
    assert elapsed < 0.5, elapsed


def test_find_symbol_address_kinds(built):
    app = str(built / "app_nopie")
    helper = find_symbol_address(app, "app_static_helper")
    assert helper is not None and helper >= 0x400000
    assert find_symbol_address(app, "no_such_symbol") is None
    libc = next(m.path for m in read_maps(os.getpid())
                if os.path.basename(m.path).startswith("libc.so"))
    # STT_OBJECT, and STT_TLS (whose value is the offset in the TLS block)
    assert find_symbol_address(libc, "stdout") > 0
    assert find_symbol_address(libc, "errno") is not None


# ---------------------------------------------------------------------------
# _PyRuntime in a static (Debian) and a shared (pyenv) interpreter.
# ---------------------------------------------------------------------------
REPORT = ("import ctypes, sys, time; print(ctypes.addressof(ctypes.c_char"
          ".in_dll(ctypes.pythonapi, '_PyRuntime')), flush=True); "
          "sys.stdin.read()")


def _pyruntime_check(python, pick_module):
    p = subprocess.Popen([python, "-c", REPORT], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        reported = int(p.stdout.readline())
        maps = read_maps(p.pid)
        module = pick_module(maps)
        vaddr = find_symbol_address(module, "_PyRuntime")
        assert vaddr is not None
        assert runtime_address(maps, module, vaddr) == reported
        # also through the process's root, as for a containerised target
        assert runtime_address(maps, module, vaddr,
                               elf_path=f"/proc/{p.pid}/root{module}") \
            == reported
        return module
    finally:
        p.kill()
        p.wait()
        p.stdin.close()
        p.stdout.close()


@pytest.mark.skipif(not os.path.exists("/usr/bin/python3.11"),
                    reason="no /usr/bin/python3.11")
def test_pyruntime_static_python():
    module = _pyruntime_check("/usr/bin/python3.11",
                              lambda maps: "/usr/bin/python3.11")
    assert module == "/usr/bin/python3.11"
    with pytest.raises(LookupError):
        runtime_address([], "/usr/bin/python3.11", 0x1234)


def _pyenv_python():
    if not shutil.which("pyenv"):
        return None
    try:
        prefix = subprocess.run(["pyenv", "prefix", "3.12.1"], check=True,
                                capture_output=True, text=True).stdout.strip()
    except subprocess.CalledProcessError:
        return None
    exe = os.path.join(prefix, "bin", "python3.12")
    return exe if os.path.exists(exe) else None


def test_pyruntime_shared_libpython():
    exe = _pyenv_python()
    if exe is None:
        pytest.skip("no pyenv 3.12.1")

    def libpython(maps):
        return next(m.path for m in maps
                    if os.path.basename(m.path).startswith("libpython3.12"))

    module = _pyruntime_check(exe, libpython)
    assert "libpython3.12" in module


# ---------------------------------------------------------------------------
# Debug files: $PYOFFCPU_DEBUG_DIRS, and the target's own root first.
# ---------------------------------------------------------------------------
from pyoffcpu.native.symbols import (DEBUG_DIRS_ENV, DEFAULT_DEBUG_DIRS, ModuleSymbols,  # noqa: E402
                                     _debug_candidates, _open_image, debug_dirs_from_env,
                                     target_root)

ROOTED_C = r"""
#include <stdio.h>
#include <unistd.h>
__attribute__((noinline, noclone)) static int rooted_helper(int x) {
    volatile int s = x;
    for (int i = 0; i < x; i++) s = s * 3 + i;
    return s;
}
int main(void) {
    printf("%p %d\n", (void *)rooted_helper, rooted_helper(3));
    fflush(stdout);
    sleep(60);
    return 0;
}
"""

DECOY_C = r"""
__attribute__((noinline)) int decoy_one(int x) { return x * 7; }
__attribute__((noinline)) int decoy_two(int x) { return decoy_one(x) + 1; }
int main(void) { return decoy_two(1); }
"""


def _readelf_build_id(path):
    out = subprocess.run(["readelf", "-n", str(path)], check=True, capture_output=True,
                         text=True).stdout
    for line in out.splitlines():
        if "Build ID:" in line:
            return line.split("Build ID:")[1].strip()
    return None


@pytest.fixture(scope="module")
def rooted(tmp_path_factory):
    """A stripped program with its debug file, and a fake root for it.

    root/opt/app/prog    the stripped program as a container would hold it
    DBG                  the host's debug directory (a temp dir standing for
                         /usr/lib/debug); root + DBG is the container's own
    prog_nobid           the same program with no build-id and a
                         .gnu_debuglink, and a decoy debug file on the host
                         (another program's) under the debuglink name"""
    if not all(shutil.which(t) for t in ("gcc", "objcopy", "strip", "readelf")):
        pytest.skip("needs gcc and binutils")
    d = tmp_path_factory.mktemp("rooted")
    (d / "rooted.c").write_text(ROOTED_C)
    (d / "decoy.c").write_text(DECOY_C)
    _run(["gcc", "-O2", "-g", "-fPIE", "-pie", "-Wl,--build-id", "-o", d / "prog", d / "rooted.c"])
    _run(["gcc", "-O2", "-g", "-fPIE", "-pie", "-Wl,--build-id=none", "-o", d / "prog_nobid",
          d / "rooted.c"])
    _run(["gcc", "-O2", "-g", "-Wl,--build-id=none", "-o", d / "decoy", d / "decoy.c"])
    for name in ("prog", "prog_nobid", "decoy"):
        _run(["objcopy", "--only-keep-debug", d / name, d / (name + ".debug")])
    helper = dict((n, s) for s, _e, n in ElfSymbols(str(d / "prog")).symbols())["rooted_helper"]
    helper_nobid = dict((n, s) for s, _e, n in
                        ElfSymbols(str(d / "prog_nobid")).symbols())["rooted_helper"]
    root = d / "root"
    app = root / "opt" / "app"
    app.mkdir(parents=True)
    shutil.copy(d / "prog", app / "prog")
    _run(["strip", "--strip-all", app / "prog"])
    bid = _readelf_build_id(app / "prog")
    assert bid and len(bid) == 40
    dbg = d / "dbg"                                   # the host's debug dir
    rel = os.path.join(".build-id", bid[:2], bid[2:] + ".debug")
    for base in (dbg, root / str(dbg).lstrip("/")):   # the host's, the root's
        (base / rel).parent.mkdir(parents=True)
        shutil.copy(d / "prog.debug", base / rel)
    # debuglink only: the real debug file inside the root, a decoy on the host
    shutil.copy(d / "prog_nobid", app / "prog_nobid")
    _run(["strip", "--strip-all", app / "prog_nobid"])
    shutil.copy(d / "prog_nobid.debug", d / "linkname.debug")
    _run(["objcopy", f"--add-gnu-debuglink={d / 'linkname.debug'}", app / "prog_nobid"])
    for base, src in ((root / str(dbg).lstrip("/"), "prog_nobid.debug"), (dbg, "decoy.debug")):
        target = base / "opt" / "app" / "linkname.debug"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(d / src, target)
    (d / "empty").mkdir()
    # a static build that runs inside the root (chroot), its debug file only there
    static_bid = None
    if subprocess.run(["gcc", "-O2", "-g", "-static", "-Wl,--build-id", "-o", d / "sprog",
                       d / "rooted.c"], capture_output=True).returncode == 0:
        _run(["objcopy", "--only-keep-debug", d / "sprog", d / "sprog.debug"])
        shutil.copy(d / "sprog", app / "sprog")
        _run(["strip", "--strip-all", app / "sprog"])
        static_bid = _readelf_build_id(app / "sprog")
        srel = os.path.join(".build-id", static_bid[:2], static_bid[2:] + ".debug")
        (root / str(dbg).lstrip("/") / srel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(d / "sprog.debug", root / str(dbg).lstrip("/") / srel)
    return {"d": d, "root": str(root), "dbg": str(dbg), "bid": bid, "rel": rel,
            "helper": helper, "helper_nobid": helper_nobid, "static_bid": static_bid}


def test_debug_dirs_from_env(monkeypatch):
    assert debug_dirs_from_env({}) == DEFAULT_DEBUG_DIRS == ("/usr/lib/debug",)
    assert debug_dirs_from_env({DEBUG_DIRS_ENV: "/a:relative::/b/"}) == ("/a", "/b")
    assert debug_dirs_from_env({DEBUG_DIRS_ENV: ""}) == ()
    monkeypatch.setenv(DEBUG_DIRS_ENV, "/nonexistent/debug")
    assert Symbolizer().debug_dirs == ("/nonexistent/debug",)
    assert Symbolizer(debug_dirs=["/x"]).debug_dirs == ("/x",)
    monkeypatch.delenv(DEBUG_DIRS_ENV)
    assert Symbolizer().debug_dirs == DEFAULT_DEBUG_DIRS


def test_debug_candidates_look_inside_the_root_first(rooted):
    root, dbg = rooted["root"], rooted["dbg"]
    path = os.path.join(root, "opt/app/prog_nobid")
    image = _open_image(path)
    assert image.build_id is None and image.debuglink == "linkname.debug"
    cands = _debug_candidates(path, image, [dbg], "/opt/app/prog_nobid", root=root)
    inside = [c for c in cands if c.startswith(root + "/")]
    # every candidate inside the root comes before every one on the host
    assert inside and cands[:len(inside)] == inside, cands
    assert os.path.join(root, dbg.lstrip("/"), "opt/app/linkname.debug") in inside
    assert os.path.join(dbg, "opt/app/linkname.debug") in cands[len(inside):]
    assert len(cands) == len(set(cands))
    # our own root: no prefix at all
    assert not any(c.startswith(root + dbg) for c in
                   _debug_candidates(path, image, [dbg], "/opt/app/prog_nobid", root="/"))
    bimage = _open_image(os.path.join(root, "opt/app/prog"))
    bc = _debug_candidates(os.path.join(root, "opt/app/prog"), bimage, [dbg], "/opt/app/prog",
                           root=root)
    assert bc[0] == os.path.join(root, dbg.lstrip("/"), rooted["rel"])
    assert os.path.join(dbg, rooted["rel"]) in bc


def test_build_id_debug_file_inside_the_root_wins(rooted):
    root, dbg, rel = rooted["root"], rooted["dbg"], rooted["rel"]
    path = os.path.join(root, "opt/app/prog")
    in_root = os.path.join(root, dbg.lstrip("/"), rel)
    elf = ElfSymbols(path, [dbg], "/opt/app/prog", root=root)
    assert elf.debug_file == in_root
    assert elf.lookup(rooted["helper"])[0] == "rooted_helper"
    # the host's copy, for a process in our root
    host = ElfSymbols(path, [dbg], "/opt/app/prog")
    assert host.debug_file == os.path.join(dbg, rel)
    # neither: the static function has no name
    bare = ElfSymbols(path, [str(rooted["d"] / "empty")], "/opt/app/prog",
                      root=str(rooted["d"] / "empty"))
    assert bare.debug_file is None and not bare.has_symtab
    assert bare.lookup(rooted["helper"]) is None or \
        bare.lookup(rooted["helper"])[0] != "rooted_helper"


def test_debuglink_inside_the_root_before_the_hosts_decoy(rooted):
    root, dbg = rooted["root"], rooted["dbg"]
    path = os.path.join(root, "opt/app/prog_nobid")
    elf = ElfSymbols(path, [dbg], "/opt/app/prog_nobid", root=root)
    assert elf.debug_file == os.path.join(root, dbg.lstrip("/"), "opt/app/linkname.debug")
    assert elf.lookup(rooted["helper_nobid"])[0] == "rooted_helper"
    # without the root the host's decoy (another program's symbols) is taken
    decoyed = ElfSymbols(path, [dbg], "/opt/app/prog_nobid")
    assert decoyed.debug_file == os.path.join(dbg, "opt/app/linkname.debug")
    hit = decoyed.lookup(rooted["helper_nobid"])
    assert hit is None or hit[0] != "rooted_helper"


def test_symbolizer_uses_the_process_root_and_reports_modules(rooted):
    """A live process of the stripped program: with its root set to the
    fake root the static function is named from the root's debug file, and
    module_symbols() says what was found; with an empty debug dir it is
    [unknown] and module_symbols() says it has no symbols."""
    d = rooted["d"]
    exe = os.path.join(rooted["root"], "opt/app/prog")
    p = subprocess.Popen([exe], stdout=subprocess.PIPE, text=True)
    try:
        addr = int(p.stdout.readline().split()[0], 16)
        space = AddressSpace.of_process(p.pid)
        sym = Symbolizer(debug_dirs=[rooted["dbg"]])
        sym.roots[p.pid] = rooted["root"]   # as if /proc/PID/root were the fake root
        r = sym.resolve_user(p.pid, addr, space)
        assert sym.frame_name(r) == "rooted_helper"
        info = sym.module_symbols()[(p.pid, exe)]
        assert isinstance(info, ModuleSymbols) and info.has_symbols and not info.has_symtab
        assert info.debug_file.startswith(rooted["root"] + "/")
        assert info.build_id == rooted["bid"] and info.root == rooted["root"]

        bare = Symbolizer(debug_dirs=[str(d / "empty")])
        r = bare.resolve_user(p.pid, addr, space)
        assert r.name is None and bare.frame_name(r) == f"prog@0x{r.fde_start:x}", r
        info = bare.module_symbols()[(p.pid, exe)]
        assert not info.has_symbols and info.root is None
        assert info.build_id_path() == os.path.join(str(d / "empty"), rooted["rel"])
    finally:
        p.kill()
        p.wait()
        p.stdout.close()


def test_chroot_process_gets_names_from_the_debug_file_in_its_root(rooted):
    """A real chroot: /proc/PID/maps names the file by our path (under the
    chroot directory); the debug file exists only inside the root, under the
    debug directory's path there."""
    if os.geteuid() != 0 or not shutil.which("chroot"):
        pytest.skip("needs root and chroot")
    if rooted["static_bid"] is None:
        pytest.skip("no static libc to build a program that runs in an empty root")
    root = rooted["root"]
    p = subprocess.Popen(["chroot", root, "/opt/app/sprog"], stdout=subprocess.PIPE, text=True)
    try:
        addr = int(p.stdout.readline().split()[0], 16)
        assert target_root(p.pid) == os.path.realpath(root)
        space = AddressSpace.of_process(p.pid)
        assert space.root == os.path.realpath(root)
        sym = Symbolizer(debug_dirs=[rooted["dbg"]])
        assert sym.frame_name(sym.resolve_user(p.pid, addr, space)) == "rooted_helper"
        info = sym.module_symbols()[(p.pid, os.path.join(root, "opt/app/sprog"))]
        assert info.target_path == "/opt/app/sprog"
        assert info.debug_file == os.path.join(
            os.path.realpath(root), rooted["dbg"].lstrip("/"), ".build-id",
            rooted["static_bid"][:2], rooted["static_bid"][2:] + ".debug")
        # the same process looked at as if it were in our root: no debug file
        host = Symbolizer(debug_dirs=[rooted["dbg"]])
        host.roots[p.pid] = None
        r = host.resolve_user(p.pid, addr, space)
        assert r.name is None and host.frame_name(r) == f"sprog@0x{r.fde_start:x}", r
    finally:
        p.kill()
        p.wait()
        p.stdout.close()


def test_target_root():
    assert target_root(os.getpid()) is None
    assert target_root(2 ** 22 + 12345) is None          # no such process
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare")
    p = subprocess.Popen(["unshare", "--mount", "sleep", "30"])
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if os.readlink(f"/proc/{p.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt"):
                break
            time.sleep(0.01)
        assert target_root(p.pid) == f"/proc/{p.pid}/root"
    finally:
        p.kill()
        p.wait()


def test_code_and_file_lines_leave_out_what_changes_with_every_allocation():
    """targets.snapshot keeps what can hold a pc or names a file: a busy
    target's heap and buffers come and go without a new parse (and without
    an AddressSpace that keeps them all)."""
    text = ("55e0a000-55e0b000 r--p 00000000 fe:01 123 /usr/bin/python3.11\n"
            "55e0b000-55e0c000 r-xp 00001000 fe:01 123 /usr/bin/python3.11\n"
            "5603c0262000-5603cd31c000 rw-p 00000000 00:00 0                          [heap]\n"
            "7f1664000000-7f1664021000 rw-p 00000000 00:00 0 \n"
            "7f1664021000-7f1668000000 ---p 00000000 00:00 0 \n"
            "7f1670000000-7f1670100000 rw-s 00000000 00:19 4242 /dev/shm/torch_1234_5678_0\n"
            "7f1671000000-7f1671001000 rw-p 0001f000 fe:01 123 /usr/bin/python3.11\n"
            "7f0000000000-7f0000001000 r-xp 00000000 00:00 0 \n"
            "7f0000002000-7f0000003000 r-xp 00000000 00:01 77 /memfd:jit (deleted)\n"
            "7ffd1000-7ffd2000 r-xp 00000000 00:00 0                  [vdso]\n"
            "7ffd5000-7ffd6000 rw-p 00000000 00:00 0                  [stack]\n")
    kept = symbols.parse_maps(symbols.code_and_file_lines(text))
    assert [(m.start, m.perms, m.path) for m in kept] == [
        (0x55e0a000, "r--p", "/usr/bin/python3.11"), (0x55e0b000, "r-xp", "/usr/bin/python3.11"),
        (0x7f0000000000, "r-xp", ""), (0x7f0000002000, "r-xp", "/memfd:jit"), (0x7ffd1000, "r-xp", "[vdso]")]
    assert [m.is_jit for m in kept] == [False, False, True, True, False]
