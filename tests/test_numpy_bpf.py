"""Native stacks through numpy's OpenBLAS (hand-written GEMM kernels with no
CFI) and its AVX-512 sort (GCC's realigned stacks: the CFA kept in the
frame), and through ONNX Runtime (MLAS kernels with neither CFI nor
symbols), in venvs the tests build from PyPI.  The workload
(workloads/numpy_mix.py) is issue 15's: a thread doing `a @ b` on 600x600
matrices, a ThreadPoolExecutor sorting arrays, a JSON thread, and
OpenBLAS's own worker threads.  Figures, each over the recording:

- the matmul thread keeps >= 3 native frames under `matmul_loop` in >= 90%
  of its on-CPU time;
- OpenBLAS's threads reach `clone3;start_thread` in >= 90% of theirs;
- the merge falls back for <= 2% of the Python time.

Run with OpenBLAS's kernel for this CPU and with the Haswell one
(OPENBLAS_CORETYPE), whose prologue keeps rsp in rbx and aligns the stack
to 4 KiB: the kernel of the issue's measurement."""
import os
import re
import subprocess

import pytest

from conftest import Workload, python_or_skip, record_folded

NUMPY = "numpy==2.4.6"      # pinned: the figures are about its OpenBLAS build
ORT = ["onnxruntime==1.32.0", "onnx==1.23.2", NUMPY]


def venv_with(tmp_path_factory, name, packages):
    """pyenv 3.11 with the packages from PyPI, in a venv of this test run."""
    base = python_or_skip("pyenv-3.11")
    venv = tmp_path_factory.mktemp(name)
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    pip = subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *packages],
                         capture_output=True, text=True)
    if pip.returncode != 0:
        pytest.skip(f"{' '.join(packages)} cannot be installed from PyPI: " + pip.stderr[-300:])
    return python


@pytest.fixture(scope="module")
def numpy_python(tmp_path_factory):
    return venv_with(tmp_path_factory, "numpy-venv", [NUMPY])


@pytest.fixture(scope="module")
def ort_python(tmp_path_factory):
    return venv_with(tmp_path_factory, "ort-venv", ORT)


def has_avx2():
    with open("/proc/cpuinfo") as f:
        flags = next((ln for ln in f if ln.startswith("flags")), "").split()
    return "avx2" in flags and "fma" in flags


def figures(prof):
    """{figure: (share, on-CPU seconds)} of one recording: the matmul thread,
    OpenBLAS's threads, and the sorting pool (its stacks through numpy's
    AVX-512 sort reach the thread's start)."""
    blas_tids = {k.tid for k in prof.weights if any(f.name == "blas_thread_server" for f in k.frames)}
    mm_total = mm_ok = blas_total = blas_ok = sort_total = sort_ok = 0
    for key, ns in prof.weights.items():
        if key.off_cpu is not None:
            continue
        names = [f.name for f in key.frames]
        kinds = [f.kind.value for f in key.frames]
        loop = next((i for i, f in enumerate(key.frames)
                     if f.kind.value == "python" and f.name == "matmul_loop"), None)
        if loop is not None:
            mm_total += ns
            native = sum(1 for k in kinds[loop + 1:] if k == "native")
            mm_ok += ns if native >= 3 else 0
        elif key.tid in blas_tids:
            blas_total += ns
            blas_ok += ns if names[:3] == ["clone3", "start_thread", "blas_thread_server"] else 0
        elif any(f.kind.value == "python" and f.name == "sort" for f in key.frames):
            sort_total += ns
            sort_ok += ns if names[:2] == ["clone3", "start_thread"] else 0
    return {name: (ok / max(total, 1), total / 1e9) for name, ok, total in (
        ("matmul", mm_ok, mm_total), ("openblas", blas_ok, blas_total), ("sort", sort_ok, sort_total))}


@pytest.mark.parametrize("coretype", [None, "Haswell"])
def test_numpy_openblas_and_sort_keep_their_native_stacks(tmp_path, bpf, numpy_python, coretype,
                                                          monkeypatch):
    if coretype == "Haswell" and not has_avx2():
        pytest.skip("OpenBLAS's Haswell kernels need AVX2 and FMA")
    if coretype:
        monkeypatch.setenv("OPENBLAS_CORETYPE", coretype)
    w = Workload(numpy_python, "numpy_mix.py", 120)
    try:
        res, prof = record_folded(tmp_path, "-p", str(w.pid), "-d", "4", "-F", "199", "--mode", "cpu")
    finally:
        w.stop()
    kernels = {f.name for k in prof.weights for f in k.frames if f.name.startswith("dgemm_kernel")}
    got = figures(prof)
    fell = re.search(r"merge fell back for (\d+)%", res.stderr)
    methods = re.search(r"native frames by how they were found[^\n]*", res.stderr)
    print(f"\nOpenBLAS {coretype or 'default'} ({', '.join(sorted(kernels))}): " + ", ".join(
        f"{name} {share:.3f} of {s:.2f} s" for name, (share, s) in got.items())
        + f"; merge fell back {fell.group(1) if fell else 0}%; {methods.group(0) if methods else ''}")
    if coretype == "Haswell":
        assert kernels == {"dgemm_kernel_HASWELL"}, kernels
        # its callers were found from prologue analysis, and the summary says so
        share = re.search(r"prologue analysis ([\d.]+)%", methods.group(0)) if methods else None
        assert share and float(share.group(1)) > 0, res.stderr
    for name, (share, seconds) in got.items():
        assert seconds > 0.3 and share >= 0.90, (name, share, seconds)
    assert fell is None or int(fell.group(1)) <= 2, res.stderr


def test_openblas_functions_without_cfi_get_rows_and_the_fast_path_changes_none(numpy_python):
    """OpenBLAS's largest library: the analysis gives rows to >= 99% of the
    bytes of its functions without an FDE (all of dgemm_kernel_HASWELL, which
    keeps rsp in rbx), and its fast path (instructions that keep the rule)
    gives exactly the rows of the slow one."""
    from elftools.elf.elffile import ELFFile
    from reference import ehframe as E
    from reference import prologue as PR
    site = subprocess.run([numpy_python, "-c", "import numpy, os; print(os.path.dirname(numpy.__file__))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    libs = os.path.join(os.path.dirname(site), "numpy.libs")
    lib = max((os.path.join(libs, n) for n in os.listdir(libs)), key=os.path.getsize)
    with open(lib, "rb") as f:
        elf = ELFFile(f)
        sec = elf.get_section_by_name(".eh_frame")
        fdes = [(x.pc_begin, x.pc_end) for x in E.parse_eh_frame(sec.data(), sec["sh_addr"])]
        syms = PR.function_symbols(lib)
        funcs = PR.uncovered_functions(syms, fdes)
        rows = PR.derived_rows(elf, fdes, syms)
        assert rows == PR.derived_rows(elf, fdes, syms, fast=False)
    assert len(funcs) > 500, len(funcs)
    ends = {start + size for start, size in funcs}
    covered = total = 0
    for (a, (kind, _, _)), (b, _) in zip(rows, rows[1:] + [(max(ends), None)]):
        if kind & ~PR.UR_DERIVED != PR.UR_INVALID:
            covered += b - a
    total = sum(size for _, size in funcs)
    print(f"\n{os.path.basename(lib)}: {len(funcs)} functions without an FDE, {total} bytes, "
          f"{100 * covered / total:.1f}% with rows")
    assert covered >= 0.99 * total
    nm = subprocess.run(["nm", "-S", "--defined-only", lib], capture_output=True, text=True, check=True).stdout
    start, size = next((int(a, 16), int(n, 16)) for a, n, _, name in
                       (ln.split() for ln in nm.splitlines() if len(ln.split()) == 4)
                       if name == "dgemm_kernel_HASWELL")
    mine = [r for r in rows if start <= r[0] < start + size]
    assert mine[-1][0] >= start + size - 16 and any(k & ~PR.UR_DERIVED == PR.UR_RBX for _, (k, _, _) in mine)


def test_onnxruntime_kernels_without_symbols_or_cfi_keep_their_stacks(tmp_path, bpf, ort_python):
    """ONNX Runtime's MLAS kernels: assembly in a stripped library, no symbol
    and no FDE.  The analysis enters that code where the library calls it or
    takes its address, and the inference thread's and the pool's stacks
    reach the thread start.  Without the analysis (PYOFFCPU_PROLOGUE=0) the
    same recording falls back for most of the Python time."""
    w = Workload(ort_python, "ort_mix.py", 120)
    try:
        res, prof = record_folded(tmp_path, "-p", str(w.pid), "-d", "4", "-F", "199", "--mode", "cpu")
    finally:
        w.stop()
    total = whole = 0
    for key, ns in prof.weights.items():
        if key.off_cpu is None:
            total += ns
            whole += ns if [f.name for f in key.frames[:2]] == ["clone3", "start_thread"] else 0
    fell = re.search(r"merge fell back for (\d+)%", res.stderr)
    methods = re.search(r"native frames by how they were found[^\n]*", res.stderr)
    print(f"\nonnxruntime: {whole / max(total, 1):.3f} of {total / 1e9:.2f} s on-CPU reach clone3;start_thread; "
          f"merge fell back {fell.group(1) if fell else 0}%; {methods.group(0) if methods else ''}")
    assert total > 3e9 and whole >= 0.90 * total, (whole, total)
    assert fell is None or int(fell.group(1)) <= 2, res.stderr
    share = re.search(r"prologue analysis ([\d.]+)%", methods.group(0)) if methods else None
    assert share and float(share.group(1)) > 0, res.stderr
