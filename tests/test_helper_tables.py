"""The compiled helper's `table` command (pytool/pyoffcpu/native/helper/tables.c)
writes exactly the bytes of the Python reference,
table_bytes(...) of tests/reference/unwind_table.py, on real libraries of
every kind the profiler meets: system libraries, static and shared
CPython, assembly without CFI (plain and stripped), OpenBLAS, ONNX Runtime
and PyTorch; and it fails cleanly on what is no readable ELF file."""
import glob
import os
import stat
import subprocess
import time

import pytest

from conftest import cached_venv, python_or_skip, torch_python
from pyoffcpu.native import helper
from pyoffcpu.native.elfcache import ElfCache
from reference import prologue
from reference import unwind_table as RT
from pyoffcpu.native.unwind import table as T
from test_nocfi_bpf import (extensions, stripped)  # noqa: F401 - fixtures: nocfi.so built as that test builds it
from test_numpy_bpf import NUMPY, ORT

LIBCRYPTO = "/usr/lib/x86_64-linux-gnu/libcrypto.so.3"


@pytest.fixture(scope="module")
def binary():
    if not os.access(helper.BINARY, os.X_OK):
        pytest.skip(f"{helper.BINARY} is not built (make helper)")
    if not prologue.available():
        pytest.skip("capstone is missing: no Python reference")
    return helper.BINARY


@pytest.fixture(scope="module")
def reference():
    """serialize(table_from_elf(...)) of a file, computed once per module
    (PyTorch's libtorch_cpu takes the Python a minute)."""
    done = {}

    def ref(path, no_prologue=False):
        key = (path, no_prologue)
        if key not in done:
            old = os.environ.get("PYOFFCPU_PROLOGUE")
            if no_prologue:
                os.environ["PYOFFCPU_PROLOGUE"] = "0"
            try:
                with open(path, "rb") as f:
                    done[key] = T.serialize(RT.table_from_elf(f, path, ElfCache()))
            finally:
                if old is None:
                    os.environ.pop("PYOFFCPU_PROLOGUE", None)
                else:
                    os.environ["PYOFFCPU_PROLOGUE"] = old
        return done[key]
    return ref


def check_same(path, reference, no_prologue=False):
    args = ["table"] + (["--no-prologue"] if no_prologue else [])
    got = helper.run(args, path)
    want = reference(path, no_prologue)
    if got != want:
        pytest.fail(f"{path}{' --no-prologue' if no_prologue else ''}: {first_difference(got, want)}")
    t = T.deserialize(got)              # and it reads back as a table
    assert t.nrows == (len(got) - 32 - 4 * (t.npages + 1)) // 8


def first_difference(got, want):
    """Where two serialized tables part, in words."""
    if len(got) < 32 or got[:32] != want[:32]:
        return f"headers differ: {got[:32].hex()} != {want[:32].hex()}"
    n = min(len(got), len(want))
    i = next((i for i in range(n) if got[i] != want[i]), n)
    row = (i - 32) // 8
    return (f"{len(got)} bytes, the reference {len(want)}; first difference at byte {i} (row {row}): "
            f"{got[32 + 8 * row:40 + 8 * row].hex()} != {want[32 + 8 * row:40 + 8 * row].hex()}")


def site_packages(python):
    return subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()


def one(pattern):
    found = sorted(glob.glob(pattern))
    assert found, f"nothing matches {pattern}"
    return found[0]


@pytest.mark.parametrize("no_prologue", [False, True])
def test_libcrypto(binary, reference, no_prologue):
    check_same(LIBCRYPTO, reference, no_prologue)


def test_debian_python_static(binary, reference):
    check_same(python_or_skip("debian-3.11"), reference)


def test_pyenv_libpython(binary, reference):
    python = python_or_skip("pyenv-3.11")
    lib = os.path.join(os.path.dirname(os.path.dirname(python)), "lib", "libpython3.11.so.1.0")
    check_same(lib, reference)


def test_assembly_without_cfi(binary, reference, extensions):   # noqa: F811
    check_same(extensions["pyenv-3.11"], reference)


@pytest.mark.parametrize("no_prologue", [False, True])
def test_assembly_without_cfi_stripped(binary, reference, stripped, no_prologue):   # noqa: F811
    """Code neither a symbol nor an FDE covers: the gaps, entered where the
    library refers to them."""
    check_same(stripped[0], reference, no_prologue)


def test_openblas(binary, reference):
    python = cached_venv("numpy", python_or_skip("pyenv-3.11"), [NUMPY])
    check_same(one(os.path.join(site_packages(python), "numpy.libs", "libscipy_openblas*.so")), reference)


@pytest.mark.parametrize("name", ["onnxruntime_pybind11_state*.so", "libonnxruntime.so.*"])
def test_onnxruntime(binary, reference, name):
    """MLAS's kernels: stripped assembly without CFI."""
    python = cached_venv("ort", python_or_skip("pyenv-3.11"), ORT)
    check_same(one(os.path.join(site_packages(python), "onnxruntime", "capi", name)), reference)


@pytest.mark.parametrize("name", ["libtorch_cpu.so", "libgomp.so.1"])
def test_pytorch(binary, reference, name):
    lib = os.path.join(site_packages(torch_python()), "torch", "lib", name)
    start = time.monotonic()
    got = helper.run(["table"], lib)
    took = time.monotonic() - start
    want = reference(lib)
    assert got == want, f"{lib}: {first_difference(got, want)}"
    assert took < 30, f"the helper took {took:.1f} s on {name}"


# ---------------------------------------------------------------------------
# What is no table
# ---------------------------------------------------------------------------
def python_fails(path):
    with open(path, "rb") as f:
        try:
            RT.table_from_elf(f, path, ElfCache())
        except Exception:               # noqa: BLE001 - what the reference's callers catch
            return True
    return False


def corrupted(tmp_path, name, change):
    data = bytearray(open(LIBCRYPTO, "rb").read())
    change(data)
    path = tmp_path / name
    path.write_bytes(bytes(data))
    return str(path)


def eh_frame(data):
    from elftools.elf.elffile import ELFFile
    import io
    sec = ELFFile(io.BytesIO(bytes(data))).get_section_by_name(".eh_frame")
    return sec["sh_offset"], sec["sh_size"]


def first_fde(data, with_program=False):
    """The file offset of the first FDE of .eh_frame (with_program: the
    first with CFA instructions past its header of GCC's "zR" kind)."""
    off, size = eh_frame(data)
    pos = off
    while pos < off + size:
        length = int.from_bytes(data[pos:pos + 4], "little")
        cie_id = int.from_bytes(data[pos + 4:pos + 8], "little")
        if cie_id != 0 and (not with_program or length > 13):
            return pos
        pos += 4 + length
    raise AssertionError("no FDE")


@pytest.mark.parametrize("case", ["truncated", "eh_frame entry past its section", "unknown CFA op",
                                  "section table past the end", "not ELF", "not x86_64"])
def test_a_malformed_file_fails_cleanly(binary, tmp_path, case):
    def truncate(d):
        del d[len(d) // 2:]             # the section headers are at the end

    def long_entry(d):
        fde = first_fde(d)
        d[fde:fde + 4] = (eh_frame(d)[1] * 2).to_bytes(4, "little")

    def bad_op(d):
        # length, CIE pointer, pc_begin, pc_range, augmentation length 0: the first instruction
        d[first_fde(d, with_program=True) + 17] = 0x3F

    def shoff(d):
        d[0x28:0x30] = (len(d) + 4096).to_bytes(8, "little")

    def not_elf(d):
        d[0:4] = b"\x7fELG"

    def machine(d):
        d[18:20] = (40).to_bytes(2, "little")   # EM_ARM

    change = {"truncated": truncate, "eh_frame entry past its section": long_entry,
              "unknown CFA op": bad_op, "section table past the end": shoff, "not ELF": not_elf,
              "not x86_64": machine}[case]
    path = corrupted(tmp_path, "bad.so", change)
    assert python_fails(path), "the reference makes a table of it: not a malformed case"
    with pytest.raises(helper.HelperError) as e:
        helper.run(["table"], path)
    assert str(e.value).startswith("pyoffcpu-elf: table: "), e.value


def test_bit_flipped_copies_fail_or_agree(binary, reference, tmp_path):
    """Whatever a flipped bit does to a file, the helper gives the
    reference's table, or fails where the reference raises (never another
    table, never a crash)."""
    import random
    rnd = random.Random(7)
    base = open(LIBCRYPTO, "rb").read()
    off, size = eh_frame(base)
    for i in range(12):
        d = bytearray(base)
        pos = off + rnd.randrange(size) if i % 2 else rnd.randrange(len(d))
        d[pos] ^= 1 << rnd.randrange(8)
        path = tmp_path / f"flip{i}.so"
        path.write_bytes(bytes(d))
        p = subprocess.run([binary, "table"], stdin=open(path, "rb"), capture_output=True,
                           env=dict(os.environ, **helper.limits_env()))
        assert p.returncode in (0, 1), (pos, p.returncode, p.stderr)
        if p.returncode == 0:
            assert p.stdout == reference(str(path)), f"byte {pos}: another table than the reference's"
        else:
            assert python_fails(str(path)), f"byte {pos}: the helper fails ({p.stderr!r}), the reference does not"


def test_a_fifo_is_refused_without_blocking(binary, tmp_path):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    start = time.monotonic()
    with pytest.raises(OSError, match="not a regular file"):
        helper.run(["table"], fifo)
    assert time.monotonic() - start < 5
    # and the binary itself takes no pipe for its ELF file
    r, w = os.pipe()
    try:
        p = subprocess.run([binary, "table"], stdin=r, capture_output=True, timeout=10,
                           env=dict(os.environ, **helper.limits_env()))
    finally:
        os.close(r)
        os.close(w)
    assert p.returncode == 1 and b"not a regular file" in p.stderr, p
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_it_sets_the_limits_it_is_given_and_runs_without_them_never(binary):
    """The limits come in its environment (no code of ours runs between
    fork and exec: the kernel can vfork); it sets them itself, and a start
    without them is refused."""
    p = subprocess.run([binary, "table"], stdin=subprocess.DEVNULL, capture_output=True, timeout=10,
                       env={})
    assert p.returncode == 2 and b"PYOFFCPU_HELPER_LIMITS" in p.stderr, p
    # a file that would take more than its address space: it fails, it does not grow
    env = {helper.LIMITS_ENV: f"{helper.CPU_LIMIT_S} {1 << 20}"}
    p = subprocess.run([binary, "table"], stdin=open(LIBCRYPTO, "rb"), capture_output=True,
                       timeout=60, env=env)
    assert p.returncode != 0, p.returncode
