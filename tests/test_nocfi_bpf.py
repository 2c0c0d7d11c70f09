"""Native stacks through assembly without CFI (workloads/nocfi_kernel.S,
called from workloads/nocfi.c): the unwinder walks them from rows of
prologue analysis.  Ground truth is the exact chain of each kernel call;
it must be complete in >= 95% of the kernels' time, with no frame that is
not on the real stack, on pyenv 3.9 / 3.11 / 3.13 and Debian's 3.11; and
again with the library stripped (hidden symbols), where the kernels are
code neither a symbol nor an FDE covers."""
import bisect
import dataclasses
import os
import re
import subprocess

import pytest

from conftest import WORKLOADS, Workload, python_or_skip, record_folded

LABELS = ["pyenv-3.9", "pyenv-3.11", "pyenv-3.13", "debian-3.11"]
KERNELS = ("nocfi_spin", "nocfi_call", "nocfi_realign")
# nocfi_rbp takes rbp, its callers' CFA is rbp-based: their rbp is lost in its
# body, so its walk ends at its caller (a frame it can still prove); the
# frames it shows must be those, never more
RBP_KERNEL, RBP_CALLERS = "nocfi_rbp", ["py_rbp", "nf_fp_outer", "nf_fp_middle", "nocfi_rbp"]
# what called each kernel, outermost first, and what it may call
CALLERS = {"spin": ["py_spin", "nf_outer", "nf_middle", "nocfi_spin"],
           "call": ["py_call", "nf_outer_cb", "nf_middle_cb", "nocfi_call"],
           "thread": ["clone3", "start_thread", "nf_thread", "nf_th_outer", "nf_middle", "nocfi_spin"],
           # rsp in rbx under a realigned stack, called from a DRAP frame (CFA = *(rbp - 40))
           "realign": ["py_realign", "nf_outer_ra", "nf_drap", "nocfi_realign"]}
BELOW = {"nocfi_spin": [[]], "nocfi_call": [[], ["nf_callback"]], "nocfi_realign": [[]]}


@pytest.fixture(scope="module")
def extensions(tmp_path_factory):
    """nocfi.so for each interpreter's headers (Debian's 3.11 takes pyenv 3.11's)."""
    out = {}
    for label in LABELS:
        minor = "3.11" if label == "debian-3.11" else label.split("-")[1]
        python = python_or_skip(label if label != "debian-3.11" else "pyenv-3.11")
        inc = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
        so = tmp_path_factory.mktemp("nocfi" + minor) / "nocfi.so"
        subprocess.run(["gcc", "-O2", "-fomit-frame-pointer", "-shared", "-fPIC", f"-I{inc}", "-o", str(so),
                        os.path.join(WORKLOADS, "nocfi.c"), os.path.join(WORKLOADS, "nocfi_kernel.S"),
                        "-lpthread"], check=True)
        out[label] = str(so)
    return out


def judge(frames):
    """(its kernel, complete, false frames) of one stack through a kernel."""
    names = [f.name for f in frames]
    k = max(i for i, n in enumerate(names) if n in KERNELS)
    kernel, below = names[k], names[k + 1:]
    false = 0 if below in BELOW[kernel] else 1
    for chain in CALLERS.values():
        if chain[-1] != kernel:
            continue
        above = names[max(0, k + 1 - len(chain)):k + 1]
        if above == chain:
            root = names[0] in ("_start", "__libc_start_main", "clone3", "clone")   # where walks end
            if chain[0] == "clone3" and names[:len(chain)] != chain:
                return kernel, False, false + 1          # something before clone3: not real
            return kernel, root, false
    # the frame above the kernel is not its caller: a false frame, unless the walk stopped there
    return kernel, False, false + (1 if k > 0 and frames[k - 1].kind.value == "native"
                                   and names[k - 1] not in sum(CALLERS.values(), []) else 0)


@pytest.mark.parametrize("label", LABELS)
def test_kernels_without_cfi_keep_their_whole_chain(tmp_path, bpf, label, extensions):
    python = python_or_skip(label)
    w = Workload(python, "nocfi.py", extensions[label], 60)
    try:
        res, prof = record_folded(tmp_path, "-p", str(w.pid), "-d", "3", "-F", "499", "--mode", "cpu")
    finally:
        w.stop()
    check_chains(label, res, prof.weights)


@pytest.fixture(scope="module")
def stripped(tmp_path_factory):
    """nocfi.so with hidden symbols, stripped: its kernels and C functions are
    code no symbol names, the kernels with no FDE either (the gaps the
    analysis enters where the code refers to them).  Returns (the stripped
    file, its functions (start, end, name) from the same build unstripped:
    the same addresses)."""
    python = python_or_skip("pyenv-3.11")
    inc = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    d = tmp_path_factory.mktemp("nocfi-stripped")
    full, so = d / "nocfi.full.so", d / "nocfi.so"
    subprocess.run(["gcc", "-O2", "-fomit-frame-pointer", "-fvisibility=hidden", "-DNOCFI_HIDDEN", "-shared",
                    "-fPIC", f"-I{inc}", "-o", str(full), os.path.join(WORKLOADS, "nocfi.c"),
                    os.path.join(WORKLOADS, "nocfi_kernel.S"), "-lpthread"], check=True)
    subprocess.run(["strip", "-s", "-o", str(so), str(full)], check=True)
    nm = subprocess.run(["nm", "-S", "--defined-only", str(full)], capture_output=True, text=True,
                        check=True).stdout
    funcs = sorted((int(a, 16), int(a, 16) + int(n, 16), name) for a, n, t, name in
                   (ln.split() for ln in nm.splitlines() if len(ln.split()) == 4) if t in "tT")
    names = subprocess.run(["nm", "-D", "--defined-only", str(so)], capture_output=True, text=True).stdout
    assert "nocfi_spin" not in names and "nf_middle" not in names, names
    return str(so), funcs


UNKNOWN = re.compile(r"^\[unknown\] nocfi\.so\+0x([0-9a-f]+)$")
# a function no symbol names but an FDE covers: named by the FDE's start,
# which must be the function's own start in the unstripped build
BY_FDE = re.compile(r"^nocfi\.so@0x([0-9a-f]+)$")


def named(frames, funcs):
    """The frames with the stripped library's addresses named from the unstripped build."""
    starts = [f[0] for f in funcs]
    out = []
    for f in frames:
        m = UNKNOWN.match(f.name)
        if m:
            addr = int(m.group(1), 16)
            i = bisect.bisect_right(starts, addr) - 1
            if i >= 0 and addr < funcs[i][1]:
                f = dataclasses.replace(f, name=funcs[i][2])
        m = BY_FDE.match(f.name)
        if m:
            i = bisect.bisect_left(starts, int(m.group(1), 16))
            if i < len(starts) and starts[i] == int(m.group(1), 16):
                f = dataclasses.replace(f, name=funcs[i][2])
        out.append(f)
    return tuple(out)


@pytest.mark.parametrize("label", ["pyenv-3.11", "debian-3.11"])
def test_stripped_kernels_keep_their_whole_chain(tmp_path, bpf, label, stripped):
    """The same chains through the stripped build: the kernels have neither a
    symbol nor an FDE, and are entered where the C code calls them."""
    so, funcs = stripped
    w = Workload(python_or_skip(label), "nocfi.py", so, 60)
    try:
        res, prof = record_folded(tmp_path, "-p", str(w.pid), "-d", "3", "-F", "499", "--mode", "cpu")
    finally:
        w.stop()
    weights = {}
    for key, ns in prof.weights.items():
        k = dataclasses.replace(key, frames=named(key.frames, funcs))
        weights[k] = weights.get(k, 0) + ns
    check_chains(label + " stripped", res, weights)


def check_chains(label, res, weights):
    """Every stack through a kernel: its exact chain, complete in >= 95% of
    the kernels' time, no false frame; the rbp kernel's walk ends at frames
    it can prove."""
    total = complete = false = rbp_ns = 0
    by = {}
    for key, ns in weights.items():
        names = [f.name for f in key.frames]
        if RBP_KERNEL in names:
            rbp_ns += ns
            k = names.index(RBP_KERNEL)
            native = [n for n, f in zip(names[:k + 1], key.frames[:k + 1]) if f.kind.value == "native"]
            tail = native[-len(RBP_CALLERS):]
            if tail != RBP_CALLERS[-len(tail):] or names[k + 1:]:
                false += 1
                print("false:", names)
            continue
        if not any(f.name in KERNELS for f in key.frames):
            continue
        kernel, ok, bad = judge(key.frames)
        total += ns
        complete += ns if ok and not bad else 0
        false += bad
        by.setdefault(kernel, [0, 0])
        by[kernel][0] += ns
        by[kernel][1] += ns if ok else 0
        if bad:
            print("false:", [f.name for f in key.frames])
    print(f"\n{label}: complete {complete / max(total, 1):.3f} of {total / 1e9:.2f} s in the kernels; "
          f"false frames {false}; " + ", ".join(f"{k} {c / max(t, 1):.3f}" for k, (t, c) in by.items()))
    assert total > 1.0e9 and rbp_ns > 0.3e9, (total, rbp_ns)
    assert false == 0
    assert complete >= 0.95 * total, (complete, total, by)
    assert by["nocfi_realign"][0] > 0.3e9 and by["nocfi_realign"][1] >= 0.95 * by["nocfi_realign"][0], by
    # the Python frames are above the main thread's kernels
    py = [k for k in weights if any(f.name == "spin_case" for f in k.frames)]
    assert py and any(f.name == "nocfi_spin" for k in py for f in k.frames)
    m = re.search(r"(\d+)% of the time needed rows from prologue analysis", res.stderr)
    assert m and int(m.group(1)) >= 50, res.stderr
