"""The .eh_frame reader and the unwind tables built from it, against
readelf's own interpretation of the same binaries (no BPF needed)."""
import os
import re
import shutil
import time
import subprocess

import pytest

from reference import ehframe as E
from reference import unwind_table as RT
from pyoffcpu.native.unwind import table as T

from conftest import pyenv_python

READELF = shutil.which("readelf")
REG_NAMES = {0: "rax", 1: "rdx", 2: "rcx", 3: "rbx", 4: "rsi", 5: "rdi", 6: "rbp", 7: "rsp"}


def pyenv_libpython():
    py = pyenv_python("3.11")
    if not py:
        return None
    lib = os.path.join(os.path.dirname(os.path.dirname(py)), "lib", "libpython3.11.so.1.0")
    return lib if os.path.exists(lib) else None


def libc():
    out = subprocess.run(["ldd", "/bin/true"], capture_output=True, text=True).stdout
    m = re.search(r"libc\.so\.6 => (\S+)", out)
    return m.group(1) if m else None


SYSTEM_BINARIES = {
    "libc": libc,
    "pyenv-libpython3.11": pyenv_libpython,
    "debian-python3.11": lambda: "/usr/bin/python3.11" if os.path.exists("/usr/bin/python3.11") else None,
}

CHAIN_C = r"""
#include <stdlib.h>
#include <string.h>
__attribute__((noipa)) long leaf(long n) { volatile long s = 0; for (long i = 0; i < n; i++) s += i; return s; }
__attribute__((noipa)) long big_frame(long n) { volatile char buf[70000]; memset((char *)buf, 1, sizeof buf); return leaf(n) + buf[n % 100]; }
__attribute__((noipa)) long realigned(long n) { __attribute__((aligned(64))) volatile char b[64]; b[0] = n; return leaf(n) + b[0]; }
__attribute__((noipa)) long dyn(long n) { volatile char *p = __builtin_alloca(n * 16 + 16); p[0] = 1; return leaf(n) + p[0]; }
int main(int argc, char **argv) { return (int)(big_frame(argc) + realigned(argc) + dyn(argc)); }
"""


def build(tmp_path, name, flags):
    src = tmp_path / "chain.c"
    src.write_text(CHAIN_C)
    out = tmp_path / name
    subprocess.run(["gcc", *flags, "-o", str(out), str(src)], check=True)
    return str(out)


def parse_file(path):
    from elftools.elf.elffile import ELFFile
    with open(path, "rb") as f:
        elf = ELFFile(f)
        sec = elf.get_section_by_name(".eh_frame")
        return E.parse_eh_frame(sec.data(), sec["sh_addr"])


def readelf_rows(path):
    """{pc_begin: (pc_end, [(loc, cfa, rbp, ra)])} from frames-interp; FDEs
    with register-to-register rules (printed with spaces) are left out."""
    # (readelf exits 1 on some system libraries after printing everything)
    out = subprocess.run([READELF, "--debug-dump=frames-interp", path],
                         capture_output=True, text=True).stdout
    fdes, cur, cols = {}, None, None
    for line in out.splitlines():
        m = re.match(r"^[0-9a-f]+ [0-9a-f]+ [0-9a-f]+ FDE cie=[0-9a-f]+ pc=([0-9a-f]+)\.\.([0-9a-f]+)", line)
        if m:
            cur = [int(m.group(2), 16), []]
            fdes[int(m.group(1), 16)] = cur
            cols = None
            continue
        if re.match(r"^[0-9a-f]+ [0-9a-f]+ [0-9a-f]+ (CIE|ZERO)", line):
            cur = None
            continue
        if cur is None:
            continue
        if line.strip().startswith("LOC"):
            cols = line.split()[1:]
            continue
        m = re.match(r"^([0-9a-f]{16}) (.*)", line)
        if m and cols:
            if "(" in m.group(2):
                fdes.pop(next(k for k, v in fdes.items() if v is cur), None)
                cur = None
                continue
            d = dict(zip(cols, m.group(2).split()))
            cur[1].append((int(m.group(1), 16), d["CFA"], d.get("rbp", "u"), d.get("ra", "u")))
    return fdes


def mine(r):
    cfa = "exp" if r.cfa_expr is not None else f"{REG_NAMES.get(r.cfa_reg, 'r%d' % r.cfa_reg)}+{r.cfa_off}"

    def rule(x):
        kind, off = x
        if kind == E.OFFSET:
            return f"c{off:+d}"
        if kind in (E.OTHER, E.AT_RBP):
            return "other"
        return "u"
    return cfa, rule(r.rbp), rule(r.ra)


def _rule(text):
    """readelf's register rule: u, c+N / c-N, or anything else (exp, vexp, a register)."""
    return text if text == "u" or re.match(r"^c[+-]\d+$", text) else "other"


def squash(rows):
    out = []
    for loc, *rule in rows:
        if not out or out[-1][1] != tuple(rule):
            out.append((loc, tuple(rule)))
    return out


def compare_with_readelf(path):
    fdes = parse_file(path)
    theirs = readelf_rows(path)
    assert len(fdes) >= len(theirs) > 0
    compared = 0
    for fde in fdes:
        t = theirs.get(fde.pc_begin)
        if t is None or not t[1]:
            continue                    # left out above, or no rows printed (CIE rule only)
        assert fde.pc_end == t[0], hex(fde.pc_begin)
        a = squash([(r.loc, *mine(r)) for r in fde.rows])
        b = squash([(loc, cfa, _rule(rbp), _rule(ra)) for loc, cfa, rbp, ra in t[1]])
        assert a == b, (hex(fde.pc_begin), a[:6], b[:6])
        compared += 1
    with_rows = sum(1 for v in theirs.values() if v[1])
    return fdes, compared, with_rows


@pytest.fixture(scope="module")
def need_readelf():
    if not READELF:
        pytest.skip("readelf (binutils) not installed")


@pytest.mark.parametrize("name", sorted(SYSTEM_BINARIES))
def test_rules_match_readelf_on_system_binaries(need_readelf, name):
    path = SYSTEM_BINARIES[name]()
    if not path:
        pytest.skip(f"{name} not installed")
    fdes, compared, with_rows = compare_with_readelf(path)
    assert compared == with_rows and compared > 0.5 * len(fdes), (compared, with_rows, len(fdes))


@pytest.mark.parametrize("fp", ["-fomit-frame-pointer", "-fno-omit-frame-pointer"])
def test_rules_match_readelf_on_fresh_builds(need_readelf, tmp_path, fp):
    path = build(tmp_path, "chain", ["-O2", fp])
    fdes, compared, with_rows = compare_with_readelf(path)
    assert compared == with_rows >= 4


def symbol(path, name):
    out = subprocess.run(["nm", path], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] == name:
            return int(parts[0], 16)
    raise AssertionError(f"{name} not in {path}")


def table_of(path):
    with open(path, "rb") as f:
        return RT.table_from_elf(f)


def test_table_lookup_agrees_with_every_parsed_row():
    path = SYSTEM_BINARIES["libc"]()
    fdes = parse_file(path)
    t = table_of(path)
    checked = 0
    for fde in fdes:
        if fde.signal_frame:
            continue
        for i, r in enumerate(fde.rows):
            if not fde.pc_begin <= r.loc < fde.pc_end:
                continue
            end = fde.rows[i + 1].loc if i + 1 < len(fde.rows) else fde.pc_end
            kind, off, rbp = RT.encode_row(r)
            for addr in {r.loc, (r.loc + end - 1) // 2 if end > r.loc else r.loc, end - 1}:
                pc, got_off, got_kind, got_rbp = t.lookup(addr)
                assert (got_kind, got_off, got_rbp) == (kind, off, rbp), (hex(addr), r)
                checked += 1
    assert checked > 10000


def test_gaps_and_outside_addresses_are_invalid(tmp_path):
    path = build(tmp_path, "chain", ["-O2", "-fomit-frame-pointer"])
    fdes = sorted(parse_file(path), key=lambda f: f.pc_begin)
    t = table_of(path)
    assert t.lookup(fdes[0].pc_begin - 1)[2] == T.UR_INVALID
    assert t.lookup(fdes[-1].pc_end)[2] == T.UR_INVALID
    assert t.lookup(fdes[-1].pc_end + 10 ** 6)[2] == T.UR_INVALID
    gaps = [(a.pc_end, b.pc_begin) for a, b in zip(fdes, fdes[1:]) if a.pc_end < b.pc_begin]
    assert gaps
    for lo, hi in gaps:
        assert t.lookup(lo)[2] == T.UR_INVALID
        assert t.lookup(hi - 1)[2] == T.UR_INVALID


def test_known_functions_get_the_rules_the_compiler_emitted(tmp_path):
    nofp = build(tmp_path, "nofp", ["-O2", "-fomit-frame-pointer"])
    t = table_of(nofp)
    # at entry every function has CFA = rsp + 8, rbp unchanged
    for fn in ("leaf", "big_frame", "realigned", "dyn", "main"):
        pc, off, kind, rbp = t.lookup(symbol(nofp, fn))
        assert (kind, off, rbp) == (T.UR_RSP, 8, 0), fn
    # a 70000-byte frame needs an offset beyond 16 bits: not followed (stop)
    kinds = {t.lookup(symbol(nofp, "big_frame") + d)[2] for d in range(0, 40)}
    assert T.UR_INVALID in kinds or T.UR_RSP in kinds
    # alloca forces a frame pointer: CFA = rbp + 16, rbp saved at CFA - 16
    dyn = symbol(nofp, "dyn")
    rules = {t.lookup(dyn + d)[1:] for d in range(0, 64)}
    assert (16, T.UR_RBP, -2) in rules, rules

    fp = build(tmp_path, "fp", ["-O2", "-fno-omit-frame-pointer"])
    t = table_of(fp)
    leaf = symbol(fp, "leaf")
    rules = {t.lookup(leaf + d)[1:] for d in range(0, 16)}
    assert (16, T.UR_RBP, -2) in rules, rules


def test_outermost_frames_and_plt_stubs():
    path = "/usr/bin/python3.11"
    if not os.path.exists(path):
        pytest.skip("Debian's python3.11 not installed")
    t = table_of(path)
    from elftools.elf.elffile import ELFFile
    with open(path, "rb") as f:
        start = ELFFile(f)["e_entry"]                 # _start (the binary is stripped)
    assert t.lookup(start + 4)[2] == T.UR_END          # cfi_undefined rip
    kinds = {t.row(i)[2] for i in range(t.nrows)}
    assert T.UR_PLT in kinds
    c = table_of(SYSTEM_BINARIES["libc"]())
    assert T.UR_PLT in {c.row(i)[2] for i in range(c.nrows)}
    assert T.UR_END in {c.row(i)[2] for i in range(c.nrows)}   # clone3's thread start


def test_plt_expression_is_recognised():
    # DW_OP_breg7 8; DW_OP_breg16 0; lit15; and; lit11; ge; lit3; shl; plus
    expr = bytes([0x77, 0x08, 0x80, 0x00, 0x3F, 0x1A, 0x3B, 0x2A, 0x33, 0x24, 0x22])
    row = E.Row(0, -1, 0, expr, (E.SAME, 0), (E.OFFSET, -8))
    assert RT.encode_row(row) == (T.UR_PLT, 8, 11)
    other = E.Row(0, -1, 0, bytes([0x77, 0xA0, 0x01, 0x06]), (E.SAME, 0), (E.OFFSET, -8))
    assert RT.encode_row(other)[0] == T.UR_INVALID     # signal frame: *(rsp + 160)


DRAP_C = r"""
extern void sink(volatile double *, long, long, long, long, long, long, long);
void realigned(long a, long b, long c, long d, long e, long f, long g) {
    volatile double x[8] __attribute__((aligned(64)));
    for (int i = 0; i < 8; i++) x[i] = a * i;
    sink(x, a, b, c, d, e, f, g);
}
"""


def test_a_stack_realigned_with_a_drap_register_gets_its_cfa_from_the_frame(tmp_path):
    """GCC keeps the CFA in the frame (DW_OP_breg6 N; DW_OP_deref) and the
    caller's rbp at rbp (DW_CFA_expression rbp: DW_OP_breg6 0)."""
    src, so = tmp_path / "d.c", tmp_path / "d.so"
    src.write_text(DRAP_C)
    subprocess.run(["gcc", "-O2", "-fomit-frame-pointer", "-shared", "-fPIC", "-o", str(so), str(src)],
                   check=True)
    fde = next(f for f in parse_file(str(so)) if any(r.cfa_expr and r.cfa_expr[0] == 0x76 for r in f.rows))
    rules = [RT.encode_row(r) for r in fde.rows]
    drap = [r for r in rules if r[0] == T.UR_DRAP]
    assert drap and all(r[1] < 0 and r[1] % 8 == 0 for r in drap), rules
    assert (T.UR_DRAP, drap[0][1], T.RBP_AT_RBP) in rules, rules
    # "rbp at rbp" is only taken where the CFA comes from rbp: after an
    # epilogue's `pop %rbp`, GCC's rule still says so of the caller's rbp
    assert all(r[2] != T.RBP_AT_RBP for r in rules if r[0] != T.UR_DRAP), rules
    expr = bytes([0x76, 0x78, 0x06])                  # DW_OP_breg6 -8; DW_OP_deref
    row = E.Row(0, -1, 0, expr, (E.AT_RBP, 0), (E.OFFSET, -8))
    assert RT.encode_row(row) == (T.UR_DRAP, -8, T.RBP_AT_RBP)
    row = E.Row(0, -1, 0, bytes([0x76, 0x78]), (E.AT_RBP, 0), (E.OFFSET, -8))
    assert RT.encode_row(row)[0] == T.UR_INVALID       # rbp - 8 itself, not the word there


def test_page_index_keeps_searches_short():
    t = table_of(SYSTEM_BINARIES["libc"]())
    assert t.max_rows_per_page() <= T.MAX_ROWS_PER_PAGE
    assert t.pages[-1] == t.nrows - 1
    assert list(t.pages) == sorted(t.pages)


def test_serialization_round_trip_and_disk_cache(tmp_path):
    path = SYSTEM_BINARIES["libc"]()
    t = table_of(path)
    again = T.deserialize(T.serialize(t))
    assert (again.base, again.rows, list(again.pages), again.page_shift) == \
        (t.base, t.rows, list(t.pages), t.page_shift)
    with pytest.raises(ValueError):
        T.deserialize(T.serialize(t)[:-4])

    cache_dir = tmp_path / "cache"
    c1 = T.TableCache(str(cache_dir))
    assert c1.get(path, "feedface").rows == t.rows
    assert c1.built == 1 and c1.loaded == 0
    c2 = T.TableCache(str(cache_dir))
    assert c2.get(path, "feedface").rows == t.rows
    assert c2.built == 0 and c2.loaded == 1
    # a damaged cache file is rebuilt, not trusted
    for f in cache_dir.iterdir():
        f.write_bytes(f.read_bytes()[:100])
    c3 = T.TableCache(str(cache_dir))
    assert c3.get(path, "feedface").rows == t.rows
    assert c3.built == 1


def test_tables_without_prologue_analysis_are_cached_apart(tmp_path, monkeypatch):
    """The same file (the same build id) with PYOFFCPU_PROLOGUE=0 and without:
    each setting builds its own table once, and never reads the other's
    (the fixture's kernels have derived rows only with the analysis)."""
    monkeypatch.setattr(T, "STAT_SETTLED_NS", -1)     # a file made this second goes to disk too
    so = tmp_path / "k.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(so),
                    os.path.join(os.path.dirname(__file__), "workloads", "nocfi_kernel.S")], check=True)
    derived = lambda t: sum(1 for i in range(t.nrows) if t.row(i)[2] & T.UR_DERIVED)   # noqa: E731
    cache_dir = str(tmp_path / "cache")
    with_rows = T.TableCache(cache_dir).get(str(so), "cafe")
    monkeypatch.setenv("PYOFFCPU_PROLOGUE", "0")
    c = T.TableCache(cache_dir)
    without = c.get(str(so), "cafe")
    assert c.built == 1 and c.loaded == 0 and derived(without) == 0 < derived(with_rows)
    monkeypatch.delenv("PYOFFCPU_PROLOGUE")
    c = T.TableCache(cache_dir)
    assert derived(c.get(str(so), "cafe")) == derived(with_rows) and c.loaded == 1


def test_cache_dir_writable_by_others_is_not_used(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    assert T.TableCache(str(d)).dir is None


def test_not_an_elf_file_gives_no_table(tmp_path):
    p = tmp_path / "junk"
    p.write_bytes(b"\x7fELF" + os.urandom(200))
    assert T.TableCache(None).get(str(p), None) is None


def test_disk_cache_keeps_the_recently_used_tables(tmp_path, monkeypatch):
    import shutil
    monkeypatch.setattr(T.TableCache, "MAX_FILES", 4)
    monkeypatch.setattr(T, "STAT_SETTLED_NS", -1)     # copies made this second go to disk too
    cache_dir = tmp_path / "cache"
    c = T.TableCache(str(cache_dir))
    copies = []
    for i in range(5):                  # five files (the key is which file it is)
        copies.append(str(tmp_path / f"libc{i}.so"))
        shutil.copy(SYSTEM_BINARIES["libc"](), copies[-1])
        c.get(copies[-1], None)
        time.sleep(0.01)
    # the fifth write went over the limit: only the newest half is left
    left = sorted(os.listdir(c.dir))
    assert len(left) == 2, left
    again = T.TableCache(str(cache_dir))
    assert again.get(copies[4], None) is not None and again.loaded == 1


def test_vdso_table_is_cached_on_disk_by_its_bytes(tmp_path):
    """The vDSO's table (it has functions without CFI: prologue analysis,
    capstone) is made once, then read from the disk cache by later
    sessions; an image that differs by one byte is another entry, whatever
    build-id it claims."""
    from pyoffcpu.native.elfcache import ElfCache
    got = ElfCache().vdso()
    if got is None:
        pytest.skip("no vDSO mapped here")
    data, info = got
    d = tmp_path / "c"
    d.mkdir(mode=0o700)
    first = T.TableCache(str(d))
    t1 = first.get_bytes("[vdso]", data, info.build_id)
    assert t1 is not None and first.built == 1 and first.loaded == 0
    again = T.TableCache(str(d))
    t2 = again.get_bytes("[vdso]", data, info.build_id)
    assert again.built == 0 and again.loaded == 1
    assert t2.rows == t1.rows
    other = bytearray(data)
    other[-1] ^= 0xff                   # past the code: the same table, another key
    third = T.TableCache(str(d))
    third.get_bytes("[vdso]", bytes(other), info.build_id)
    assert third.loaded == 0 and third.built == 1
