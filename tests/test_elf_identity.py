"""ELF files are parsed once per session, by file identity, never by path
(pyoffcpu.elffile), and the symbolizer and the unwinder share what was
parsed: the files, the vDSO, the load bias."""

import builtins
import ctypes
import os
import shutil
import subprocess
import time

import pytest

from conftest import pyenv_python
from pyoffcpu.native import elfcache, elffile, fileidentity, symbols
from pyoffcpu.native.elfcache import ElfCache
from pyoffcpu.native.elffile import LoadSegment, identify, load_bias
from pyoffcpu.native.symbols import Mapping, Symbolizer
from pyoffcpu.native.unwind import loader, walk
from pyoffcpu.native.unwind import table as T

LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"
PYTHON311 = "/usr/bin/python3.11"


def _pyenv_libpython():
    exe = pyenv_python("3.12")
    lib = exe and os.path.join(os.path.dirname(os.path.dirname(exe)), "lib", "libpython3.12.so.1.0")
    return lib if lib and os.path.exists(lib) else None


REAL_FILES = [p for p in (LIBC, PYTHON311, _pyenv_libpython()) if p and os.path.exists(p)]


def _gcc(tmp, name, source, *flags):
    src = tmp / f"{name}.c"
    src.write_text(source)
    out = tmp / name
    subprocess.run(["gcc", "-O1", "-o", str(out), str(src), *flags], check=True)
    return str(out)


def _program(n):
    return (f"#include <stdio.h>\n"
            f"__attribute__((noinline)) int only_in_{n}(int x) {{ return x * 3 + 1; }}\n"
            "static __attribute__((noinline)) int local_helper(int x) { return x ^ 0x55; }\n"
            f"int main(int c, char **v) {{ printf(\"%d\\n\", only_in_{n}(c) + local_helper(c)); }}\n")


def _big_program(n):
    """Two of these (n = "a", "b") differ only in one static function's name
    deep inside .strtab: same size, same first and last 4 KiB."""
    lines = ["#include <stdio.h>",
             f"static __attribute__((noinline)) int zz_only_in_{n}(int x) {{ return x * 3 + 1; }}"]
    lines += [f"__attribute__((noinline)) static int filler_function_with_a_long_name_{i:04d}"
              f"(int x) {{ return x + {i}; }}" for i in range(300)]
    lines.append(f"int main(int argc, char **argv) {{ int s = zz_only_in_{n}(argc);")
    lines += [f"  s += filler_function_with_a_long_name_{i:04d}(argc);" for i in range(300)]
    lines.append('  printf("%d\\n", s); return 0; }')
    return "\n".join(lines)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not shutil.which("gcc"):
        pytest.skip("no gcc")
    d = tmp_path_factory.mktemp("elfid")
    return {
        "a": _gcc(d, "prog_a", _program("a")),
        "b": _gcc(d, "prog_b", _program("b")),
        "nobid": _gcc(d, "prog_nobid", _program("a"), "-Wl,--build-id=none"),
        "big_a": _gcc(d, "big_a", _big_program("a"), "-Wl,--build-id=none"),
        "big_b": _gcc(d, "big_b", _big_program("b"), "-Wl,--build-id=none"),
    }


class _CountingELFFile:
    """Counts ELF header parses by file identity: elffile._Headers (the
    struct reader ElfFile uses), and pyelftools' ELFFile where elffile still
    calls it (compressed sections)."""

    def __init__(self, monkeypatch):
        self.by_identity = {}
        counter = self

        def count(stream):
            ident = identify(stream.getvalue() if hasattr(stream, "getvalue") else stream)
            counter.by_identity[ident] = counter.by_identity.get(ident, 0) + 1

        real = elffile.ELFFile

        def counting(stream, *a, **kw):
            count(stream)
            return real(stream, *a, **kw)
        monkeypatch.setattr(elffile, "ELFFile", counting)

        class CountingHeaders(elffile._Headers):
            def __init__(self, stream):
                count(stream)
                super().__init__(stream)
        monkeypatch.setattr(elffile, "_Headers", CountingHeaders)


def _names(elf):
    return {name for _s, _e, name in elf.symbols()}


def _other_paths(tmp_path, path):
    """The file at ``path`` under three more names: a symlink, a copy (another
    inode, the same bytes) and a hard link (to the copy when the file lives
    on another file system)."""
    base = os.path.basename(path)
    link = tmp_path / f"symlink-{base}"
    os.symlink(path, link)
    copy = tmp_path / f"copy-{base}"
    shutil.copyfile(path, copy)
    hard = tmp_path / f"hardlink-{base}"
    try:
        os.link(path, hard)
    except OSError:
        os.link(copy, hard)
    return [str(link), str(copy), str(hard)]


# ---------------------------------------------------------------------------
# One parse per file, whatever its path
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("path", REAL_FILES, ids=os.path.basename)
def test_a_file_under_four_names_is_parsed_once(tmp_path, monkeypatch, path):
    parses = _CountingELFFile(monkeypatch)
    cache = ElfCache()
    sym = Symbolizer(debug_dirs=[], elf_cache=cache)
    paths = [path] + _other_paths(tmp_path, path)
    elfs = [sym.elf_for_path(p) for p in paths]
    # every other way of reading symbols goes through the same entry
    for p in paths:
        assert cache.defined_symbols(p, ["malloc", "_PyRuntime"]) == \
            cache.defined_symbols(path, ["malloc", "_PyRuntime"])
        symbols.find_symbol_address(p, "_PyRuntime", debug_dirs=[], cache=cache)
        assert cache.get(p) is cache.get(path)
    assert len(cache) == 1
    assert cache.parses == 1 and cache.symbol_loads == 1
    assert list(parses.by_identity.values()) == [1]
    # the four views share one function index, and name the same functions
    assert all(e.index is elfs[0].index for e in elfs)
    assert len(elfs[0]) > 100 and {e.path for e in elfs} == set(paths)


def test_the_symbolizer_the_unwinder_and_detection_share_one_parse_per_file(tmp_path,
                                                                            monkeypatch):
    """Everything mapped by this process (the interpreter, libc, extension
    modules, the vDSO), read for symbols, unwind tables and data symbols:
    each file's headers are parsed once."""
    parses = _CountingELFFile(monkeypatch)
    cache = ElfCache()
    pid = os.getpid()
    maps = symbols.read_maps(pid)
    u = loader.NativeUnwinder(None, cache=T.TableCache(str(tmp_path / "tables")),
                              elf_cache=cache)
    assert u.update(pid, maps)
    sym = Symbolizer(debug_dirs=[], elf_cache=cache)
    space = symbols.AddressSpace(pid, maps)
    for m in maps:
        if "x" in m.perms:
            sym.resolve_user(pid, m.start, space)
        if m.is_file:
            cache.defined_symbols(m.path, ["_PyRuntime", "Py_Version"])
    assert len(cache) >= 3
    assert cache.parses == len(cache)
    assert parses.by_identity and set(parses.by_identity.values()) == {1}, parses.by_identity


# ---------------------------------------------------------------------------
# Identity: not the path
# ---------------------------------------------------------------------------
def test_a_file_replaced_at_its_path_is_a_new_entry(tmp_path, built):
    cache = ElfCache()
    sym = Symbolizer(debug_dirs=[], elf_cache=cache)
    path = str(tmp_path / "prog")
    shutil.copyfile(built["a"], path)
    first = sym.elf_for_path(path)
    assert "only_in_a" in _names(first)
    os.replace(shutil.copyfile(built["b"], str(tmp_path / "new")), path)
    second = sym.elf_for_path(path)
    assert second.image.identity != first.image.identity
    assert "only_in_b" in _names(second) and "only_in_a" not in _names(second)
    assert cache.parses == 2 and len(cache) == 2
    # the old file's entry is still there, for whoever maps the old file
    assert "only_in_a" in _names(sym.elf_for_path(built["a"]))
    assert cache.parses == 2


def test_a_file_rewritten_in_place_with_its_old_size_and_mtime_is_a_new_entry(tmp_path, built,
                                                                           monkeypatch):
    """The identity of an unchanged file is read once (fstat says it is the
    same file); rewriting its bytes in place, same size, with its mtime set
    back, still changes its ctime, which no program can set back.  A file
    changed within the last second is read every time (file times have a
    clock tick's grain)."""
    assert os.path.getsize(built["big_a"]) == os.path.getsize(built["big_b"])
    cache = ElfCache()
    path = str(tmp_path / "prog")
    shutil.copyfile(built["big_a"], path)
    first = cache.get(path, symbols=True)
    assert cache.get(path) is first and cache.identifies == 2     # just written: read again
    monkeypatch.setattr(elfcache, "STAT_SETTLED_NS", 0)            # as if it were old
    cache.get(path)
    for _ in range(5):
        assert cache.get(path) is first
    assert cache.identifies == 3
    st = os.stat(path)
    time.sleep(0.05)                    # past the tick of the last change
    with open(built["big_b"], "rb") as src, open(path, "r+b") as dst:
        dst.write(src.read())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns
    second = cache.get(path, symbols=True)
    assert second.identity != first.identity and cache.identifies == 4
    with open(built["big_b"], "rb") as f:
        assert second.identity == identify(f)


def test_a_file_without_a_build_id_is_named_by_its_bytes(tmp_path, built):
    cache = ElfCache()
    with open(built["nobid"], "rb") as f:
        ident = identify(f)
    assert ident.build_id is None and ident.kind == "hash"
    assert ident.size == os.path.getsize(built["nobid"])
    with open(built["a"], "rb") as f:
        assert identify(f).kind == "build-id"
    copy = str(tmp_path / "elsewhere")
    shutil.copyfile(built["nobid"], copy)
    sym = Symbolizer(debug_dirs=[], elf_cache=cache)
    a, b = sym.elf_for_path(built["nobid"]), sym.elf_for_path(copy)
    assert a.image is b.image and a.build_id is None
    assert {"only_in_a", "local_helper", "main"} <= _names(a)
    assert cache.parses == 1


def test_same_size_head_and_tail_with_other_symbols_is_another_file(built):
    """Two builds without build-id that the size and first and last 4 KiB
    cannot tell apart: the identity covers the symbol tables too, so neither
    is handed the other's names."""
    with open(built["big_a"], "rb") as fa, open(built["big_b"], "rb") as fb:
        a, b = fa.read(), fb.read()
    span = fileidentity.IDENTITY_SPAN
    assert len(a) == len(b) and a[:span] == b[:span] and a[-span:] == b[-span:] and a != b
    cache = ElfCache()
    sym = Symbolizer(debug_dirs=[], elf_cache=cache)
    ea, eb = sym.elf_for_path(built["big_a"]), sym.elf_for_path(built["big_b"])
    assert ea.image.identity != eb.image.identity and cache.parses == 2
    assert "zz_only_in_a" in _names(ea) and "zz_only_in_a" not in _names(eb)
    assert "zz_only_in_b" in _names(eb)


def test_a_stripped_copy_keeps_the_build_id_but_is_another_entry(tmp_path, built):
    """strip keeps the build-id: the stripped file must not get the
    unstripped one's local symbols (nor the reverse)."""
    stripped = str(tmp_path / "stripped")
    subprocess.run(["strip", "-o", stripped, built["a"]], check=True)
    cache = ElfCache()
    sym = Symbolizer(debug_dirs=[], elf_cache=cache)
    full, bare = sym.elf_for_path(built["a"]), sym.elf_for_path(stripped)
    assert full.build_id == bare.build_id is not None
    assert full.image is not bare.image and cache.parses == 2
    assert full.has_symtab and not bare.has_symtab
    assert "local_helper" in _names(full) and "local_helper" not in _names(bare)


# ---------------------------------------------------------------------------
# The vDSO and the load bias: one reader each
# ---------------------------------------------------------------------------
def test_the_vdso_is_read_once(tmp_path, monkeypatch):
    pid = os.getpid()
    maps = symbols.read_maps(pid)
    vdso = next((m for m in maps if m.path == "[vdso]"), None)
    if vdso is None:
        pytest.skip("no vDSO")
    reads = []
    real_open = builtins.open

    def counting_open(file, *a, **kw):
        if file == "/proc/self/mem":
            reads.append(file)
        return real_open(file, *a, **kw)
    monkeypatch.setattr(builtins, "open", counting_open)
    cache = ElfCache()
    sym = Symbolizer(elf_cache=cache)
    space = symbols.AddressSpace(pid, maps)
    names = {sym.frame_name(sym.resolve_user(pid, a, space))
             for a in range(vdso.start, vdso.end, 16)}
    assert any("clock_gettime" in n for n in names), names
    u = loader.NativeUnwinder(None, cache=T.TableCache(str(tmp_path / "t")), elf_cache=cache)
    u.update(pid, maps)
    Symbolizer(elf_cache=cache).resolve_user(pid, vdso.start, space)
    assert any(r[0] == vdso.start for r in u._regions[pid])
    assert cache.vdso_reads == 1 and len(reads) == 1


def test_load_bias_agrees_between_symbolizer_and_unwinder():
    """For every executable mapping of this process: the unwinder's table
    base, the symbolizer's address -> ELF address and runtime_address all
    use one load bias, and it is right (a libc function's ELF address plus
    the bias is where ctypes finds it)."""
    pid = os.getpid()
    maps = symbols.read_maps(pid)
    space = symbols.AddressSpace(pid, maps)
    cache = ElfCache()
    u = loader.NativeUnwinder(None, elf_cache=cache)
    u.update(pid, maps)
    sym = Symbolizer(debug_dirs=[], elf_cache=cache)
    regions = {r[0]: r for r in u._regions[pid]}
    checked = with_table = 0
    for m in maps:
        if "x" not in m.perms or not (m.is_file or m.path == "[vdso]"):
            continue
        elf = sym._elf_for_mapping(pid, m, space)
        assert elf is not None, m
        bias = elf.load_bias(m)
        assert bias is not None, m
        if m.start in regions and regions[m.start][3] is not walk.NO_TABLE:   # a file without a table: none to agree
            start, _end, base, table = regions[m.start]
            assert base - table.base == bias, m
            with_table += 1
        for a in range(m.start, m.end, max(1, (m.end - m.start) // 64)):
            vaddr = elf.address_to_vaddr(a, m)
            if vaddr is not None:
                assert a - vaddr == bias, (m, hex(a))
                checked += 1
        if m.is_file:
            first = min((x for x in maps if x.path == m.path), key=lambda x: x.start)
            assert symbols.runtime_address(maps, m.path, 0x40, cache=cache) == \
                0x40 + load_bias(first, elf.segments)
    assert checked > 100 and with_table >= 2
    libc = next(m.path for m in maps if os.path.basename(m.path) == "libc.so.6")
    getpid = ctypes.cast(ctypes.CDLL(libc).getpid, ctypes.c_void_p).value
    vaddr = symbols.find_symbol_address(libc, "getpid", debug_dirs=[], cache=cache)
    assert symbols.runtime_address(maps, libc, vaddr, cache=cache) == getpid
    hit = sym.resolve_user(pid, getpid, space)
    assert hit.offset == vaddr and hit.symbol_offset == 0
    m = space.find(getpid)
    start, _end, base, table = regions[m.start]
    assert getpid - (base - table.base) == vaddr


def test_load_bias_of_packed_segments_follows_the_mapping_permissions():
    """lld packs segments without padding them to pages: the read-only and
    the executable mapping both start at file offset 0, and only the
    segment with the mapping's permissions gives its bias."""
    segs = [LoadSegment(0x0, 0x0, 0x5a4, 0x5a4, 0x1000, 4),            # R
            LoadSegment(0x5b0, 0x15b0, 0x190, 0x190, 0x1000, 5),       # R E
            LoadSegment(0x740, 0x2740, 0x100, 0x200, 0x1000, 6)]       # RW
    base = 0x7f0000000000
    ro = Mapping(base, base + 0x1000, 0, "r--p", "/x", 1)
    rx = Mapping(base + 0x1000, base + 0x2000, 0, "r-xp", "/x", 1)
    assert load_bias(ro, segs) == base
    assert load_bias(rx, segs) == base
    assert load_bias(Mapping(base, base + 0x1000, 0x5000, "r-xp", "/x", 1), segs) is None
