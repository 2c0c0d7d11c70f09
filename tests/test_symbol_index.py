"""The function index (pyoffcpu.symindex, helper/symbols.c): it names every
address as functable.function_table does, the compiled helper and the
Python fallback write the same bytes, a damaged index gives no name and no
exception, code only an FDE covers is named by the FDE's start, and the
demangler in the process reads names as c++filt does."""

import bisect
import os
import random
import re
import shutil
import stat
import subprocess

import pytest

from conftest import torch_python
from pyoffcpu.native import demangle as D
from pyoffcpu.native import helper, symindex
from pyoffcpu.native.elfcache import ElfCache
from reference.functable import function_table as _function_table
from reference import symbol_index as RS
from pyoffcpu.native.symbols import AddressSpace, ElfSymbols, Mapping, Symbolizer, demangle
from reference import ehframe

LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"
PYTHON311 = "/usr/bin/python3.11"

# Aliases (one address, many names), weak and local symbols, unsized ones
# (assembly without .size), a sized and an unsized symbol at one address, and
# names that rank differently by bytes than by characters.
SMALL_C = r"""
__attribute__((noinline)) int real_fn(int x) { return x * 3 + 1; }
int alias_fn(int) __attribute__((alias("real_fn")));
int _under_alias(int) __attribute__((alias("real_fn")));
int zzab(int) __attribute__((alias("real_fn")));
int zz\u00e9(int) __attribute__((alias("real_fn")));
__attribute__((weak, noinline)) int weak_fn(int x) { return x + 2; }
int weak_alias(int) __attribute__((weak, alias("weak_fn")));
static __attribute__((noinline)) int local_fn(int x) { return x ^ 5; }
int call_local(int x) { return local_fn(x) + 1; }
asm(".text\n"
    ".globl unsized_global\n.type unsized_global,@function\nunsized_global:\n"
    "  nop\n  nop\n  ret\n"
    ".type unsized_local,@function\nunsized_local:\n  nop\n  ret\n"
    ".globl sized_too\n.type sized_too,@function\n"
    ".type unsized_at_sized,@function\n"
    "sized_too:\nunsized_at_sized:\n  nop\n  nop\n  nop\n  ret\n"
    ".size sized_too, 4\n"
    ".type zz_invalid_utf8_a,@function\n.type zz_invalid_utf8_b,@function\n"
    "zz_invalid_utf8_a:\nzz_invalid_utf8_b:\n  ret\n  .size zz_invalid_utf8_a, 1\n"
    "  .size zz_invalid_utf8_b, 1\n"
    ".type unsized_last,@function\nunsized_last:\n  nop\n  ret\n");
int main(int c, char **v) { (void)v; return real_fn(c) + weak_fn(c) + call_local(c); }
"""


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The small C program; two of its names patched in .strtab to bytes
    that are not UTF-8 (same length), so ranking is by raw bytes."""
    if not shutil.which("gcc"):
        pytest.skip("no gcc")
    d = tmp_path_factory.mktemp("symidx")
    src = d / "small.c"
    src.write_text(SMALL_C)
    out = d / "small"
    subprocess.run(["gcc", "-O1", "-fno-inline", "-o", str(out), str(src)], check=True)
    data = out.read_bytes()
    for old, new in ((b"zz_invalid_utf8_a\0", b"zz_invalid_utf8\xff\xfe\0"),
                     (b"zz_invalid_utf8_b\0", b"zz_invalid_utf8\xc3(\0")):
        assert data.count(old) == 1
        data = data.replace(old, new)
    out.write_bytes(data)
    return str(out)


@pytest.fixture(scope="module")
def torch_lib():
    python = torch_python()
    lib = os.path.join(os.path.dirname(os.path.dirname(python)), "lib", "python3.11",
                       "site-packages", "torch", "lib")
    if not os.path.isdir(lib):
        pytest.skip("no torch/lib in the torch venv")
    return lib


@pytest.fixture(autouse=True)
def no_disk_cache(monkeypatch):
    monkeypatch.setenv("PYOFFCPU_CACHE_DIR", "")


def _elf(path, cache=None):
    return ElfSymbols(path, cache=cache or ElfCache())


def _helper_bytes(elf):
    if not helper.available():
        pytest.skip("pyoffcpu-elf is not built (make helper)")
    return helper.run(["symbols"], elf._paths[0], elf._paths[1:])


def _python_bytes(elf):
    """The fallback's index, from symbol tables decoded by ElfFile."""
    images = []
    for image, path in zip(elf._sources, elf._paths):
        with open(path, "rb") as f:
            image.load_symbols(f)
        images.append(image)
    with open(elf._paths[0], "rb") as f:
        eh, addr = RS.eh_frame_of(images[0], lambda off, n: os.pread(f.fileno(), n, off))
    return RS.build_bytes(images, eh, addr)


def _reference_lookup(table, vaddr):
    """ElfSymbols.lookup as it was, over _function_table's lists."""
    starts, ends, names = table
    i = bisect.bisect_right(starts, vaddr) - 1
    if i >= 0 and vaddr < ends[i]:
        return names[i].encode("utf-8", "surrogateescape").decode("utf-8", "replace"), starts[i]
    return None


def _check_against_function_table(elf, sample=None):
    """The index names every address as _function_table does: every start,
    addresses in between, the ends and just past them."""
    images = []
    for image, path in zip(elf._sources, elf._paths):
        with open(path, "rb") as f:
            image.load_symbols(f)
        images.append(image)
    table = _function_table(images)
    starts, ends, names = table
    idx = elf.index
    assert idx.valid and len(idx) == len(starts) > 0
    got = idx.entries()
    assert [(s, e) for s, e, _n in got] == list(zip(starts, ends))
    assert [n for _s, _e, n in got] == [
        n.encode("utf-8", "surrogateescape").decode("utf-8", "replace") for n in names]
    rng = random.Random(23)
    which = range(len(starts)) if sample is None or sample >= len(starts) else \
        rng.sample(range(len(starts)), sample)
    for i in which:
        s, e = starts[i], ends[i]
        for a in {s, s + 1, (s + e) // 2, e - 1, e, max(0, s - 1), e + rng.randrange(1, 64)}:
            assert elf.lookup(a) == _reference_lookup(table, a), (hex(a), i)
    return table


# ---------------------------------------------------------------------------
# The index names what _function_table names; helper and fallback agree
# ---------------------------------------------------------------------------
def test_small_program_aliases_weak_local_unsized(small):
    elf = _elf(small)
    starts, ends, names = _check_against_function_table(elf)
    by_name = {n: (s, e) for s, e, n in zip(starts, ends, names)}
    # one name per address: global, sized, plain, shortest; ties by byte order
    # (zz\u00e9 is 3 characters but 4 bytes: zzab wins on its bytes)
    assert "zzab" in by_name and "zz\u00e9" not in by_name and "real_fn" not in by_name
    assert "weak_fn" in by_name and "local_fn" in by_name
    assert "sized_too" in by_name and "unsized_at_sized" not in by_name
    # unsized ones end at the next function
    s, e = by_name["unsized_global"]
    assert e == by_name["unsized_local"][0]
    # raw bytes: b"zz_invalid_utf8\xc3(" < b"zz_invalid_utf8\xff\xfe"
    s, _e = by_name["zz_invalid_utf8\udcc3("]
    assert elf.lookup(s) == ("zz_invalid_utf8\ufffd(", s)
    assert _helper_bytes(elf) == _python_bytes(elf)


def test_libc(tmp_path):
    elf = _elf(LIBC)
    _check_against_function_table(elf)
    assert _helper_bytes(elf) == _python_bytes(elf)


def test_python311_with_its_debug_file():
    if not os.path.exists(PYTHON311):
        pytest.skip("no /usr/bin/python3.11")
    elf = _elf(PYTHON311)
    assert elf.debug_file and elf.debug_file.startswith("/usr/lib/debug/.build-id/"), \
        "python3.11-dbg's debug file (apt-get install python3.11-dbg)"
    assert len(elf._sources) == 2
    _check_against_function_table(elf)
    assert _helper_bytes(elf) == _python_bytes(elf)
    hit = elf.lookup(elf.symbols()[0][0])
    assert hit is not None


def test_libtorch_cpu(torch_lib):
    elf = _elf(os.path.join(torch_lib, "libtorch_cpu.so"))
    starts, _e, _n = _check_against_function_table(elf, sample=20000)
    assert len(starts) > 300000
    assert _helper_bytes(elf) == _python_bytes(elf)


def test_fde_ranges_are_the_unwinders(torch_lib):
    """fde_ranges reads .eh_frame as unwind/ehframe.py does (its FDEs'
    pc_begin / pc_end)."""
    for path in (LIBC, os.path.join(torch_lib, "libgomp.so.1")):
        elf = _elf(path)
        image = elf.image
        with open(path, "rb") as f:
            data, addr = RS.eh_frame_of(image, lambda off, n: os.pread(f.fileno(), n, off))
        theirs = sorted({(t.pc_begin, t.pc_end) for t in ehframe.parse_eh_frame(data, addr)})
        assert RS.fde_ranges(data, addr) == theirs
        assert elf.index.fdes() == theirs and len(theirs) > 100


# ---------------------------------------------------------------------------
# Damaged indexes
# ---------------------------------------------------------------------------
def test_a_damaged_index_gives_no_names_and_no_exception(small):
    good = _python_bytes(_elf(small))
    idx = symindex.SymbolIndex(good)
    starts = [s for s, _e, _n in idx.entries()]
    fdes = idx.fdes()
    assert idx.valid and starts and fdes
    probes = starts + [s + 1 for s in starts] + [0, 1, 2**64 - 1, 2**64, -1] + [s for s, _e in fdes]

    def harmless(buf):
        ix = symindex.SymbolIndex(buf)
        for a in probes:
            hit = ix.lookup(a)
            assert hit is None or isinstance(hit[0], str)
            ix.fde_start(a)
        ix.entries()
        ix.fdes()
        return ix

    for n in sorted({0, 1, 8, 63, 64, 65, len(good) // 2, len(good) - 1}):
        ix = harmless(good[:n])                        # truncated
        assert not ix.valid and all(ix.lookup(a) is None for a in probes)
        assert all(ix.fde_start(a) is None for a in probes)
    assert not harmless(good + b"x").valid             # longer than its header says
    assert not harmless(b"XXXXXXXX" + good[8:]).valid  # another magic
    assert not harmless(good[:8] + b"\x02" + good[9:]).valid   # another version
    huge = bytearray(good)
    huge[16:24] = (2**62).to_bytes(8, "little")        # counts that overflow
    assert not harmless(bytes(huge)).valid
    # inside a valid header: garbage everywhere but the header, at random
    rng = random.Random(5)
    for _ in range(200):
        bad = bytearray(good)
        for _ in range(rng.randint(1, 40)):
            bad[rng.randrange(symindex.HEADER.size, len(bad))] = rng.randrange(256)
        harmless(bytes(bad))
    # name offsets out of bounds: no name, not a read outside the names
    nf = idx.nfuncs
    bad = bytearray(good)
    off0 = symindex.HEADER.size + 16 * nf
    bad[off0 + 8:off0 + 16] = (2**63).to_bytes(8, "little")
    ix = harmless(bytes(bad))
    assert ix.lookup(starts[0]) is None


def test_the_disk_cache(monkeypatch, tmp_path, small):
    """The index is cached under PYOFFCPU_CACHE_DIR/symbols (0600, keyed by
    the files' identities), mapped from there by the next session; a
    damaged cache file is built again."""
    monkeypatch.setenv("PYOFFCPU_CACHE_DIR", str(tmp_path))
    first = _elf(small)
    want = first.symbols()
    files = os.listdir(tmp_path / "symbols")
    assert len(files) == 1 and files[0].endswith(".sym")
    path = tmp_path / "symbols" / files[0]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert path.read_bytes() == _python_bytes(first)
    again = _elf(small)
    assert again.symbols() == want and isinstance(again.index._buf, type(first.index._buf))
    # damaged (cache files are replaced whole, never rewritten in place: a
    # mapped one keeps its bytes)
    damaged = tmp_path / "damaged"
    damaged.write_bytes(path.read_bytes()[:100])
    os.replace(damaged, path)
    third = _elf(small)
    assert third.symbols() == want
    assert path.read_bytes() == _python_bytes(first)   # and written again


ZLIB_LOOP = """
import sys, time, zlib
end = time.monotonic() + float(sys.argv[1])
data = bytes(range(256)) * 400
while time.monotonic() < end:
    zlib.compress(data)
"""


def test_a_recording_without_the_helper_works_and_says_why_frames_lack_names(tmp_path, bpf):
    """A source tree nobody built the helper in: the recording works (its
    Python frames, native stacks by frame pointer) and says, once each,
    that nothing makes unwind tables and why native frames have no names,
    instead of pointing at a debug package that would not help."""
    from conftest import ROOT, env, pyoffcpu_cmd, python_or_skip
    python = python_or_skip("pyenv-3.12")
    tree = tmp_path / "tree"
    shutil.copytree(os.path.join(ROOT, "pytool"), tree, symlinks=False,
                    ignore=shutil.ignore_patterns("__pycache__", "pyoffcpu-elf", "*.egg-info"))
    busy = tmp_path / "busy.py"
    busy.write_text(ZLIB_LOOP)
    out = tmp_path / "out.folded"
    e = env()
    e["PYTHONPATH"], e["PYOFFCPU_CACHE_DIR"] = str(tree), ""
    res = subprocess.run(pyoffcpu_cmd("-o", str(out), "--", python, str(busy), "2"), env=e,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    missing = f"{tree}/pyoffcpu/native/helper/pyoffcpu-elf is not built (make install)"
    assert res.stderr.count(missing) == 1, res.stderr                   # names
    assert res.stderr.count("pyoffcpu-elf is not built: make install): files without") == 1, res.stderr
    assert "dbgsym" not in res.stderr and "debug file" not in res.stderr, res.stderr
    assert re.search(r"<module> \(\S*busy\.py:6\)", out.read_text()), out.read_text()[:2000]


def test_without_the_helper_a_file_has_no_names_and_nothing_fails(monkeypatch, small):
    """The helper is the one builder: where it is not built, a file's
    index is empty (its frames keep file and offset), and nothing raises."""
    monkeypatch.setattr(helper, "BINARY", "/nonexistent/pyoffcpu-elf")
    assert not helper.available()
    elf = _elf(small)
    assert elf.symbols() == []
    assert elf.lookup(elf.segments[0].vaddr + 0x10) is None


# ---------------------------------------------------------------------------
# Code only an FDE covers: named by the FDE's start
# ---------------------------------------------------------------------------
def test_fde_names_in_a_stripped_libgomp(torch_lib):
    path = os.path.join(torch_lib, "libgomp.so.1")
    cache = ElfCache()
    sym = Symbolizer(debug_dirs=[], elf_cache=cache)
    elf = sym.elf_for_path(path)
    assert not elf.has_symtab and elf.debug_file is None
    # the executable segment, mapped at BASE (a process that is not ours)
    seg = next(s for s in elf.segments if s.flags & 1)
    base = 0x7F0000000000
    lo = seg.vaddr & ~0xFFF
    m = Mapping(base + lo, base + seg.vaddr + seg.memsz, seg.offset & ~0xFFF, "r-xp", path,
                os.stat(path).st_ino)
    space = AddressSpace(None, [m])
    pid = 2**22 + 1                                    # no such process
    uncovered = [(s, e) for s, e in elf.index.fdes() if elf.lookup(s) is None
                 and elf.lookup(e - 1) is None and e - s > 2]
    assert len(uncovered) > 50
    for s, e in uncovered[:50]:
        names = {sym.frame_name(sym.resolve_user(pid, base + a, space)) for a in (s, s + 1, e - 1)}
        assert names == {f"libgomp.so.1@0x{s:x}"}
        r = sym.resolve_user(pid, base + s + 1, space)
        assert r.name is None and r.fde_start == s and r.symbol_offset == 1
    # the function's code, by its FDE's range, from the file itself
    s, e = uncovered[0]
    ident, start, end, code = sym.function_code(pid, base + s + 1, space)
    with open(path, "rb") as f:
        f.seek(s - seg.vaddr + seg.offset)
        assert (ident, start, end, code) == (elf.image.identity, s, e, f.read(e - s))
    # a symbol still wins where there is one; neither: [unknown]
    fs, _fe, fname = elf.symbols()[0]
    assert sym.frame_name(sym.resolve_user(pid, base + fs, space)) == fname
    fdes = elf.index.fdes()
    gaps = [e for (_s, e), (s2, _e2) in zip(fdes, fdes[1:]) if s2 > e and elf.lookup(e) is None]
    if gaps:
        assert sym.frame_name(sym.resolve_user(pid, base + gaps[0], space)) == \
            f"[unknown] libgomp.so.1+0x{gaps[0]:x}"


# ---------------------------------------------------------------------------
# Demangling in the process
# ---------------------------------------------------------------------------
def test_cxa_demangle_reads_names_as_cxxfilt(torch_lib):
    if not D.available():
        pytest.skip("no libstdc++")
    if not shutil.which("c++filt"):
        pytest.skip("no c++filt (binutils)")
    elf = _elf(os.path.join(torch_lib, "libtorch_cpu.so"))
    names = sorted({n for _s, _e, n in elf.symbols() if n.startswith("_Z")})
    rng = random.Random(11)
    sample = rng.sample(names, 20000)
    sample += [n for n in names if ".isra." in n][:300] + [n for n in names if ".cold" in n][:300]
    sample += [n for n in names if ".constprop." in n][:300]
    sample += [n for n in names if "RSo" in n or "RSi" in n or "Ss" in n][:300]
    sample = sorted(set(sample))
    proc = subprocess.run(["c++filt"], input="\n".join(sample) + "\n", capture_output=True,
                          text=True, check=True)
    theirs = dict(zip(sample, proc.stdout.split("\n")))
    ours = demangle(sample)
    assert [n for n in sample if ours[n] != theirs[n]] == []
    assert sum(ours[n] != n for n in sample) > 0.99 * len(sample)


def test_huge_and_malformed_names_do_not_raise():
    cases = ["_Z", "_Z" + "A" * 70000, "_Z1fI" + "P" * 65000 + "iEvv", "_ZN" + "1a" * 32000 + "Ev",
             "_Z" + "St" * 30000, "_Z\udcff\udcfe", "_Z3foo\x01", "_ZZ" * 20000,
             "_Z1f" + "I1a" * 21000,
             "_Z3foo" + "\0", "_Z" + "9" * 40, "_ZN1aE" * 10000]
    for name in cases:
        assert D.demangle(name) == name
        assert demangle([name])[name] == name
    assert D.demangle("_ZN4demo6Widget4spinEi") == "demo::Widget::spin(int)"
    assert D.demangle("_Z3foov.isra.0") == "foo() [clone .isra.0]"
    assert D.demangle("_ZNKSs4sizeEv") == \
        "std::basic_string<char, std::char_traits<char>, std::allocator<char> >::size() const"
    assert D.demangle("plain") == "plain"
