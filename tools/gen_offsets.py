#!/usr/bin/env python3
"""Generate ``pytool/pyoffcpu/cpython/offsets_table.py`` from real CPython headers.

Usage::

    python3 tools/gen_offsets.py            # (re)write the committed table
    python3 tools/gen_offsets.py --check    # regenerate in memory; exit 1 if the
                                            # committed file differs
    python3 tools/gen_offsets.py --print    # print the generated module to stdout

What it does
------------
For every pyenv CPython 3.7 .. 3.13 installation found under ``$(pyenv root)/versions``
(``$PYENV_ROOT`` or ``~/.pyenv`` when the ``pyenv`` command is missing; only plain
``3.X.Y`` release names, so free-threaded ``3.13t`` builds are ignored) it writes a
small C probe, compiles it with ``gcc -DPy_BUILD_CORE`` (falling back to
``-DPy_BUILD_CORE_MODULE``) against ``<prefix>/include/python3.X[m]`` and
``<prefix>/include/python3.X[m]/internal``, runs it, and collects the
``offsetof()`` / ``sizeof()`` values listed in :data:`KEYS`.  A field that a
version does not have is -1.

3.15 is compiled the same way inside the Debian testing root that
``tools/build-chroot.sh`` builds (``$PYOFFCPU_CHROOT``, default
``/var/cache/pyoffcpu/chroot/forky``), against Debian's ``libpython3.15-dev``
headers (``/usr/include/python3.15``), with the root's gcc; that needs root.

The result is the data module ``OFFSETS = {(3, 7): {...}, ...}``.  3.14 has no
compiled headers in the table; its values are transcribed from the reference document
(``/work/shared/reference/cpython-frames.md``, "from source, not compiled") into a
separate ``OFFSETS_FROM_SOURCE`` dict, -1 where the document gives nothing (plus
the autoTSSkey position, SOURCE_314_EXTRA below).

From 3.13 on the probe also prints where ``_Py_DebugOffsets`` (the struct at the
start of ``_PyRuntime``) keeps each value it publishes: ``DEBUG_POSITIONS``
(compiled) and ``DEBUG_POSITIONS_FROM_SOURCE`` (3.14, DEBUG_POSITIONS_314 below).
The loader reads those values from the target and prefers them to the table.

Self checks (the script fails, printing every mismatch, when one does not hold):

* every version yields exactly the expected set of present / absent (-1) keys;
* when a minor version has several pyenv patch releases they agree;
* the compiled values equal the reference document's offsets table (section 1)
  for every field and version the document lists (3.8 .. 3.13); "-" in the
  document must be -1 here;
* the probe's extra values (``sizeof(_PyInterpreterFrame)``, ``tstate->cframe``
  in 3.10) match the document too, though they are not part of the table;
* the ``_Py_DebugOffsets`` positions equal those the document lists (3.13
  compiled, 3.14 transcribed).

Requirements: ``gcc`` and the pyenv installs (headers ship with them).  Only
x86_64 Linux, default (GIL, release) builds are meant.
"""

import argparse
import difflib
import os
import re
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE_PATH = os.path.join(REPO, "pytool", "pyoffcpu", "cpython", "offsets_table.py")
GENERATE_CMD = "python3 tools/gen_offsets.py"

MIN_MINOR, MAX_MINOR = 7, 13
# Minor versions compiled in the Debian testing root (Debian's -dev headers).
CHROOT_MINORS = (15,)
CHROOT = os.path.realpath(os.environ.get("PYOFFCPU_CHROOT", "/var/cache/pyoffcpu/chroot/forky"))

# Table keys, in output order.
KEYS = (
    "runtime_interpreters_head",
    "runtime_autotss",
    "tss_is_initialized",
    "tss_key",
    "interp_next",
    "interp_threads_head",
    "runtime_gil",
    "interp_ceval_gil",
    "gil_last_holder",
    "gil_locked",
    "tstate_next",
    "tstate_interp",
    "tstate_thread_id",
    "tstate_native_thread_id",
    "tstate_frame",
    "tstate_cframe",
    "cframe_current_frame",
    "tstate_current_frame",
    "frame_back",
    "frame_code",
    "frame_lasti",
    "iframe_code",
    "iframe_previous",
    "iframe_instr",
    "iframe_is_entry",
    "iframe_owner",
    "code_firstlineno",
    "code_filename",
    "code_name",
    "code_qualname",
    "code_linetable",
    "code_code",
    "code_code_adaptive",
    "code_firsttraceable",
    "bytes_size",
    "bytes_data",
    "unicode_length",
    "unicode_state",
    "ascii_data",
    "compact_data",
    "compact_utf8",
    "compact_utf8_length",
    "object_type",
    "type_basicsize",
    "type_name",
    "owner_cstack",
    "owner_generator",
)

# Probe values that are only used for cross-checking, never written to the table.
EXTRA_KEYS = ("x_iframe_size", "x_tstate_cframe")

# _Py_DebugOffsets (3.13+): the table keys CPython also publishes at run time,
# and the member of the struct that holds each one.  The probe prints the
# position of every member (``dbg_<key>``); the table gets DEBUG_POSITIONS.
DEBUG_FIELDS = (
    ("version", "version"),
    ("free_threaded", "free_threaded"),
    ("runtime_interpreters_head", "runtime_state.interpreters_head"),
    ("interp_next", "interpreter_state.next"),
    ("interp_threads_head", "interpreter_state.threads_head"),
    ("interp_ceval_gil", "interpreter_state.ceval_gil"),
    ("tstate_next", "thread_state.next"),
    ("tstate_interp", "thread_state.interp"),
    ("tstate_current_frame", "thread_state.current_frame"),
    ("tstate_thread_id", "thread_state.thread_id"),
    ("tstate_native_thread_id", "thread_state.native_thread_id"),
    ("iframe_previous", "interpreter_frame.previous"),
    ("iframe_code", "interpreter_frame.executable"),
    ("iframe_instr", "interpreter_frame.instr_ptr"),
    ("iframe_owner", "interpreter_frame.owner"),
    ("code_filename", "code_object.filename"),
    ("code_name", "code_object.name"),
    ("code_qualname", "code_object.qualname"),
    ("code_linetable", "code_object.linetable"),
    ("code_firstlineno", "code_object.firstlineno"),
    ("code_code_adaptive", "code_object.co_code_adaptive"),
    ("object_type", "pyobject.ob_type"),
    ("type_name", "type_object.tp_name"),
    ("bytes_size", "bytes_object.ob_size"),
    ("bytes_data", "bytes_object.ob_sval"),
    ("unicode_state", "unicode_object.state"),
    ("unicode_length", "unicode_object.length"),
    ("ascii_data", "unicode_object.asciiobject_size"),
)
DEBUG_KEYS = tuple(key for key, _ in DEBUG_FIELDS) + ("sizeof",)

# 3.14 positions, NOT compiled: summed by hand from the _Py_DebugOffsets of
# py-spy's bindgen output for the v3.14.0 headers (src/python_bindings/v3_14_0.rs;
# every member a u64 after char cookie[8]); they agree with every position the
# reference document lists (cpython-frames.md section 3).  interp_ceval_gil
# (after threads_main, gc, imports_modules, sysdict, builtins) was read here
# from Debian's 3.14.8: 16 there, with gil_runtime_state + 8 / + 16 at the
# holder's and locked's positions beside it.
DEBUG_POSITIONS_314 = {
    "version": 8, "free_threaded": 16,
    "runtime_interpreters_head": 40,
    "interp_next": 64, "interp_threads_head": 72, "interp_ceval_gil": 120,
    "tstate_next": 192, "tstate_interp": 200, "tstate_current_frame": 208,
    "tstate_thread_id": 216, "tstate_native_thread_id": 224,
    "iframe_previous": 256, "iframe_code": 264, "iframe_instr": 272, "iframe_owner": 288,
    "code_filename": 320, "code_name": 328, "code_qualname": 336, "code_linetable": 344,
    "code_firstlineno": 352, "code_code_adaptive": 384,
    "object_type": 408, "type_name": 424,
    "bytes_size": 600, "bytes_data": 608,
    "unicode_state": 624, "unicode_length": 632, "ascii_data": 640,
    "sizeof": 760,
}

# 3.14 values the reference document does not give, NOT compiled either:
# _PyRuntime.autoTSSkey, from the same bindgen output (v3.14.0, and v3.14.5
# unchanged): every _PyRuntimeState member before it has its 3.13 size except
# _Py_DebugOffsets (584 -> 760 bytes), so 3.13's 2160 + 176.  Py_tss_t is
# {int _is_initialized; pthread_key_t _key;} as before.  The loader does not
# trust this number alone: it derives the key from the live threads too.
# The GIL: struct _gil_runtime_state of a default build is 3.12's
# {interval; last_holder; locked; ...}, and PyInterpreterState still starts
# with its ceval state {instrumentation_version; recursion_limit; gil; ...}
# (v3.14.0 Include/internal/pycore_gil.h, pycore_interp_structs.h); the
# loader prefers the published ceval_gil and checks the GIL it points to.
SOURCE_314_EXTRA = {"runtime_autotss": 2336, "tss_is_initialized": 0, "tss_key": 4,
                    "interp_ceval_gil": 16, "gil_last_holder": 8, "gil_locked": 16}

# Keys that must be -1 for a given minor version (anything else must be >= 0).
_FRAMEOBJ = {"tstate_frame", "frame_back", "frame_code", "frame_lasti", "code_code"}
_IFRAME = {"iframe_code", "iframe_previous", "iframe_instr", "iframe_owner",
           "code_code_adaptive", "code_firsttraceable", "code_qualname",
           "owner_generator", "tstate_native_thread_id"}
_CFRAME = {"tstate_cframe", "cframe_current_frame"}


def expected_absent(minor):
    absent = set()
    absent.add("interp_ceval_gil" if minor <= 11 else "runtime_gil")
    if minor >= 15:
        # 3.15 keeps each thread's PyThreadState in thread-local variables
        # (_Py_tss_gilstate), not under a pthread key; and its frames have no
        # FRAME_OWNED_BY_CSTACK owner
        absent |= {"runtime_autotss", "owner_cstack"}
    if minor <= 10:
        absent |= _IFRAME | _CFRAME | {"iframe_is_entry", "owner_cstack",
                                       "tstate_current_frame"}
    else:
        absent |= _FRAMEOBJ
        if minor != 11:
            absent.add("iframe_is_entry")
        if minor == 11:
            absent.add("owner_cstack")
        if minor >= 13:
            absent |= _CFRAME
        else:
            absent.add("tstate_current_frame")
    return absent


# The C probe.  Each P() line prints "key value"; keys a version lacks are not
# printed and become -1.
PROBE_C = r"""
#include <Python.h>
#include <frameobject.h>
#include <stddef.h>
#include <stdio.h>

#if PY_VERSION_HEX < 0x03080000
#  include "internal/pystate.h"
#elif PY_VERSION_HEX < 0x03090000
#  include "internal/pycore_pystate.h"
#else
#  include "internal/pycore_runtime.h"
#  include "internal/pycore_interp.h"
#endif
#if PY_VERSION_HEX >= 0x030B0000
#  include "internal/pycore_frame.h"
#endif

#define P(key, val) printf("%s %ld\n", key, (long)(val))

int main(void)
{
    printf("version %d.%d.%d\n", PY_MAJOR_VERSION, PY_MINOR_VERSION, PY_MICRO_VERSION);

    P("runtime_interpreters_head", offsetof(_PyRuntimeState, interpreters.head));
#if PY_VERSION_HEX < 0x030C0000
    P("runtime_autotss", offsetof(_PyRuntimeState, gilstate.autoTSSkey));
#elif PY_VERSION_HEX < 0x030F0000
    P("runtime_autotss", offsetof(_PyRuntimeState, autoTSSkey));
#endif
    P("tss_is_initialized", offsetof(Py_tss_t, _is_initialized));
    P("tss_key", offsetof(Py_tss_t, _key));

    P("interp_next", offsetof(PyInterpreterState, next));
#if PY_VERSION_HEX < 0x030B0000
    P("interp_threads_head", offsetof(PyInterpreterState, tstate_head));
#else
    P("interp_threads_head", offsetof(PyInterpreterState, threads.head));
#endif

    /* The GIL: 3.7-3.11 one, in _PyRuntime; 3.12+ the interpreter's
     * ceval.gil points to the one it uses (its own _gil, or the main one's) */
#if PY_VERSION_HEX < 0x030C0000
    P("runtime_gil", offsetof(_PyRuntimeState, ceval.gil));
#else
    P("interp_ceval_gil", offsetof(PyInterpreterState, ceval.gil));
#endif
    P("gil_last_holder", offsetof(struct _gil_runtime_state, last_holder));
    P("gil_locked", offsetof(struct _gil_runtime_state, locked));

    P("tstate_next", offsetof(PyThreadState, next));
    P("tstate_interp", offsetof(PyThreadState, interp));
    P("tstate_thread_id", offsetof(PyThreadState, thread_id));
#if PY_VERSION_HEX >= 0x030B0000
    P("tstate_native_thread_id", offsetof(PyThreadState, native_thread_id));
#endif

#if PY_VERSION_HEX < 0x030B0000
    P("tstate_frame", offsetof(PyThreadState, frame));
    P("frame_back", offsetof(PyFrameObject, f_back));
    P("frame_code", offsetof(PyFrameObject, f_code));
    P("frame_lasti", offsetof(PyFrameObject, f_lasti));
#endif
#if PY_VERSION_HEX >= 0x030A0000 && PY_VERSION_HEX < 0x030D0000
    P("x_tstate_cframe", offsetof(PyThreadState, cframe));
#endif
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030D0000
    P("tstate_cframe", offsetof(PyThreadState, cframe));
    P("cframe_current_frame", offsetof(_PyCFrame, current_frame));
#endif
#if PY_VERSION_HEX >= 0x030D0000
    P("tstate_current_frame", offsetof(PyThreadState, current_frame));
#endif

#if PY_VERSION_HEX >= 0x030B0000
#  if PY_VERSION_HEX < 0x030D0000
    P("iframe_code", offsetof(_PyInterpreterFrame, f_code));
    P("iframe_instr", offsetof(_PyInterpreterFrame, prev_instr));
#  else
    P("iframe_code", offsetof(_PyInterpreterFrame, f_executable));
    P("iframe_instr", offsetof(_PyInterpreterFrame, instr_ptr));
#  endif
    P("iframe_previous", offsetof(_PyInterpreterFrame, previous));
#  if PY_VERSION_HEX < 0x030C0000
    P("iframe_is_entry", offsetof(_PyInterpreterFrame, is_entry));
#  endif
    P("iframe_owner", offsetof(_PyInterpreterFrame, owner));
    P("x_iframe_size", sizeof(_PyInterpreterFrame));
    P("owner_generator", FRAME_OWNED_BY_GENERATOR);
#  if PY_VERSION_HEX >= 0x030C0000 && PY_VERSION_HEX < 0x030F0000
    P("owner_cstack", FRAME_OWNED_BY_CSTACK);
#  endif

#endif

    P("code_firstlineno", offsetof(PyCodeObject, co_firstlineno));
    P("code_filename", offsetof(PyCodeObject, co_filename));
    P("code_name", offsetof(PyCodeObject, co_name));
#if PY_VERSION_HEX < 0x030A0000
    P("code_linetable", offsetof(PyCodeObject, co_lnotab));
#else
    P("code_linetable", offsetof(PyCodeObject, co_linetable));
#endif
#if PY_VERSION_HEX < 0x030B0000
    P("code_code", offsetof(PyCodeObject, co_code));
#else
    P("code_qualname", offsetof(PyCodeObject, co_qualname));
    P("code_code_adaptive", offsetof(PyCodeObject, co_code_adaptive));
    P("code_firsttraceable", offsetof(PyCodeObject, _co_firsttraceable));
#endif

    P("bytes_size", offsetof(PyVarObject, ob_size));
    P("bytes_data", offsetof(PyBytesObject, ob_sval));
    P("unicode_length", offsetof(PyASCIIObject, length));
    P("unicode_state", offsetof(PyASCIIObject, state));
    P("ascii_data", sizeof(PyASCIIObject));
    P("compact_data", sizeof(PyCompactUnicodeObject));
    P("compact_utf8", offsetof(PyCompactUnicodeObject, utf8));
    P("compact_utf8_length", offsetof(PyCompactUnicodeObject, utf8_length));
    P("object_type", offsetof(PyObject, ob_type));
    P("type_basicsize", offsetof(PyTypeObject, tp_basicsize));
    P("type_name", offsetof(PyTypeObject, tp_name));

#if PY_VERSION_HEX >= 0x030D0000
#  define D(key, member) P("dbg_" key, offsetof(_Py_DebugOffsets, member))
@DEBUG_LINES@
    P("dbg_sizeof", sizeof(_Py_DebugOffsets));
#endif
    return 0;
}
"""
PROBE_C = PROBE_C.replace("@DEBUG_LINES@", "\n".join(
    '    D("%s", %s);' % (key, member) for key, member in DEBUG_FIELDS))

# ---------------------------------------------------------------------------
# Reference document values (cpython-frames.md, section 1), transcribed.
# None means "-" (field absent) and must correspond to -1 in the table.
# ---------------------------------------------------------------------------
_DOC_VERSIONS = ((3, 8), (3, 9), (3, 10), (3, 11), (3, 12), (3, 13), (3, 14))
_n = None
_DOC_ROWS = {
    "runtime_interpreters_head": (32, 32, 32, 40, 40, 632, 808),
    "interp_next":               (0, 0, 0, 0, 0, 7264, 7272),
    "interp_threads_head":       (8, 8, 8, 16, 72, 7344, 7344),
    "tstate_next":               (8, 8, 8, 8, 8, 8, 8),
    "tstate_interp":             (16, 16, 16, 16, 16, 16, 16),
    "tstate_thread_id":          (176, 176, 176, 152, 136, 152, 152),
    "tstate_native_thread_id":   (_n, _n, _n, 160, 144, 160, 160),
    "tstate_frame":              (24, 24, 24, _n, _n, _n, _n),
    "tstate_cframe":             (_n, _n, _n, 56, 56, _n, _n),
    "x_tstate_cframe":           (_n, _n, 48, 56, 56, _n, _n),
    "cframe_current_frame":      (_n, _n, _n, 8, 0, _n, _n),
    "tstate_current_frame":      (_n, _n, _n, _n, _n, 72, 72),
    "frame_back":                (24, 24, 24, _n, _n, _n, _n),
    "frame_code":                (32, 32, 32, _n, _n, _n, _n),
    "frame_lasti":               (104, 104, 96, _n, _n, _n, _n),
    "iframe_code":               (_n, _n, _n, 32, 0, 0, 0),
    "iframe_previous":           (_n, _n, _n, 48, 8, 8, 8),
    "iframe_instr":              (_n, _n, _n, 56, 56, 56, 56),
    "iframe_is_entry":           (_n, _n, _n, 68, _n, _n, _n),
    "iframe_owner":              (_n, _n, _n, 69, 70, 70, 74),
    "x_iframe_size":             (_n, _n, _n, 80, 80, 80, 88),
    "code_firstlineno":          (40, 40, 40, 72, 68, 68, 68),
    "code_filename":             (104, 104, 104, 112, 112, 112, 112),
    "code_name":                 (112, 112, 112, 120, 120, 120, 120),
    "code_qualname":             (_n, _n, _n, 128, 128, 128, 128),
    "code_linetable":            (120, 120, 120, 136, 136, 136, 136),
    "code_code_adaptive":        (_n, _n, _n, 184, 192, 200, 208),
    "code_firsttraceable":       (_n, _n, _n, 168, 176, 184, 192),
    "code_code":                 (48, 48, 48, _n, _n, _n, _n),
    "bytes_size":                (16, 16, 16, 16, 16, 16, 16),
    "bytes_data":                (32, 32, 32, 32, 32, 32, 32),
    "unicode_length":            (16, 16, 16, 16, 16, 16, 16),
    "unicode_state":             (32, 32, 32, 32, 32, 32, 32),
    "ascii_data":                (48, 48, 48, 48, 40, 40, 40),
    "compact_data":              (72, 72, 72, 72, 56, 56, 56),
    "compact_utf8":              (56, 56, 56, 56, 48, 48, 48),
    "object_type":               (8, 8, 8, 8, 8, 8, 8),
    # Frame-owner enum values (doc: GENERATOR=1 in 3.11-3.14; CSTACK=3 in
    # 3.12/3.13, 4 in 3.14; 3.11 has no CSTACK owner).
    "owner_generator":           (_n, _n, _n, 1, 1, 1, 1),
    "owner_cstack":              (_n, _n, _n, _n, 3, 3, 4),
}
REFERENCE_DOC = {
    ver: {key: row[i] for key, row in _DOC_ROWS.items()}
    for i, ver in enumerate(_DOC_VERSIONS)
}


def from_source_314():
    """3.14 values from the reference document (not compiled); -1 elsewhere."""
    doc = REFERENCE_DOC[(3, 14)]
    out = {key: (doc[key] if doc.get(key) is not None else -1) for key in KEYS}
    out.update(SOURCE_314_EXTRA)
    return out


# ---------------------------------------------------------------------------
# Discovery and compilation
# ---------------------------------------------------------------------------
def pyenv_root():
    exe = shutil.which("pyenv")
    if exe:
        try:
            out = subprocess.run([exe, "root"], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, universal_newlines=True,
                                 check=True).stdout.strip()
            if out:
                return out
        except (OSError, subprocess.CalledProcessError):
            pass
    return os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")


def find_installs():
    """Return {(3, minor): [(patch_version_str, include_dir), ...]} for 3.7..3.13."""
    found = {}
    vdir = os.path.join(pyenv_root(), "versions")
    if not os.path.isdir(vdir):
        return found
    for name in sorted(os.listdir(vdir)):
        m = re.fullmatch(r"3\.(\d+)\.(\d+)", name)
        if not m:
            continue
        minor = int(m.group(1))
        if not MIN_MINOR <= minor <= MAX_MINOR:
            continue
        inc = None
        for cand in ("python3.%d" % minor, "python3.%dm" % minor):
            path = os.path.join(vdir, name, "include", cand)
            if os.path.isfile(os.path.join(path, "Python.h")):
                inc = path
                break
        if inc is None:
            continue
        found.setdefault((3, minor), []).append((name, inc))
    for lst in found.values():
        lst.sort(key=lambda item: tuple(int(x) for x in item[0].split(".")))
    return found


def find_chroot_installs():
    """{(3, minor): [(None, include_dir)]} for the CHROOT_MINORS whose Debian
    headers the root holds (include_dir as seen inside the root); {} when
    there is no root, or we are not root (chroot(2) needs it)."""
    found = {}
    if os.geteuid() != 0:
        return found
    for minor in CHROOT_MINORS:
        inc = "/usr/include/python3.%d" % minor
        if os.path.isfile(os.path.join(CHROOT + inc, "internal", "pycore_debug_offsets.h")):
            found[(3, minor)] = [(None, inc)]
    return found


def compile_probe(include_dir, workdir, root=None):
    """Compile and run the probe against one install; return {key: int}.
    `root`: compile and run it inside that root (chroot), where `workdir`
    and `include_dir` are paths as seen from inside."""
    outside = (root or "") + workdir
    src = os.path.join(workdir, "probe.c")
    exe = os.path.join(workdir, "probe")
    with open(os.path.join(outside, "probe.c"), "w") as fh:
        fh.write(PROBE_C)
    pre = ["chroot", root] if root else []
    errors = []
    for define in ("-DPy_BUILD_CORE", "-DPy_BUILD_CORE_MODULE"):
        cmd = pre + ["gcc", "-std=gnu11", "-O0", define,
                     "-I", include_dir, "-I", os.path.join(include_dir, "internal"),
                     src, "-o", exe]
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             universal_newlines=True)
        if res.returncode == 0:
            break
        errors.append("$ %s\n%s" % (" ".join(cmd), res.stderr[-4000:]))
    else:
        raise RuntimeError("probe did not compile for %s:\n%s"
                           % (include_dir, "\n".join(errors)))
    out = subprocess.run(pre + [exe], stdout=subprocess.PIPE, universal_newlines=True,
                         check=True).stdout
    values = {}
    for line in out.splitlines():
        key, val = line.split()
        values[key] = val if key == "version" else int(val)
    return values


def generate():
    """Compile every install; return (offsets, sources, extras, problems)."""
    if shutil.which("gcc") is None:
        raise RuntimeError("gcc not found")
    installs = find_installs()
    if not installs:
        raise RuntimeError("no pyenv CPython 3.%d-3.%d with headers found under %s"
                           % (MIN_MINOR, MAX_MINOR, pyenv_root()))
    in_root = find_chroot_installs()
    installs.update(in_root)
    offsets, sources, extras, debug, problems = {}, {}, {}, {}, []
    with tempfile.TemporaryDirectory(prefix="gen_offsets.") as tmp, \
            tempfile.TemporaryDirectory(prefix="gen_offsets.", dir=CHROOT + "/tmp"
                                        if in_root else None) as root_tmp:
        for ver in sorted(installs):
            per_patch = []
            for name, inc in installs[ver]:
                if ver in in_root:
                    vals = compile_probe(inc, root_tmp[len(CHROOT):], root=CHROOT)
                    name = vals.pop("version") + " (Debian)"
                else:
                    vals = compile_probe(inc, tmp)
                    if vals.pop("version") != name:
                        problems.append("%s: headers report another version" % name)
                per_patch.append((name, vals))
            name, vals = per_patch[-1]
            for other, ovals in per_patch[:-1]:
                if ovals != vals:
                    diff = sorted(k for k in set(vals) | set(ovals)
                                  if vals.get(k) != ovals.get(k))
                    problems.append("3.%d: %s and %s differ in %s"
                                    % (ver[1], other, name, ", ".join(diff)))
            debug[ver] = {k[4:]: vals.pop(k) for k in list(vals) if k.startswith("dbg_")}
            unknown = set(vals) - set(KEYS) - set(EXTRA_KEYS)
            if unknown:
                problems.append("3.%d: probe printed unknown keys %s"
                                % (ver[1], sorted(unknown)))
            table = {key: vals.get(key, -1) for key in KEYS}
            absent = {key for key, val in table.items() if val == -1}
            if absent != expected_absent(ver[1]):
                problems.append("3.%d: absent keys %s, expected %s"
                                % (ver[1], sorted(absent),
                                   sorted(expected_absent(ver[1]))))
            offsets[ver] = table
            sources[ver] = [n for n, _ in per_patch]
            extras[ver] = {k: vals.get(k, -1) for k in EXTRA_KEYS}
            want = set(DEBUG_KEYS)
            if ver >= (3, 13) and set(debug[ver]) != want:
                problems.append("3.%d: _Py_DebugOffsets positions missing for %s"
                                % (ver[1], sorted(want - set(debug[ver]))))
    debug = {ver: pos for ver, pos in debug.items() if pos}
    return offsets, sources, extras, debug, problems


# Positions in _Py_DebugOffsets the reference document lists (section 3), for
# the self-check; 3.14's are those of DEBUG_POSITIONS_314.
REFERENCE_DEBUG = {
    (3, 13): {"version": 8, "free_threaded": 16, "runtime_interpreters_head": 40,
              "interp_next": 64, "interp_threads_head": 72, "tstate_next": 168,
              "tstate_current_frame": 184, "tstate_thread_id": 192,
              "tstate_native_thread_id": 200, "iframe_previous": 232, "iframe_code": 240,
              "iframe_instr": 248, "iframe_owner": 264, "code_filename": 280,
              "code_name": 288, "code_qualname": 296, "code_linetable": 304,
              "code_firstlineno": 312, "code_code_adaptive": 344, "bytes_size": 520,
              "bytes_data": 528, "unicode_state": 544, "unicode_length": 552,
              "ascii_data": 560, "sizeof": 584},
    (3, 14): {"version": 8, "free_threaded": 16, "runtime_interpreters_head": 40,
              "interp_next": 64, "interp_threads_head": 72, "tstate_next": 192,
              "tstate_current_frame": 208, "tstate_thread_id": 216,
              "tstate_native_thread_id": 224, "iframe_previous": 256, "iframe_code": 264,
              "iframe_instr": 272, "iframe_owner": 288, "code_filename": 320,
              "code_name": 328, "code_qualname": 336, "code_linetable": 344,
              "code_firstlineno": 352, "code_code_adaptive": 384, "bytes_size": 600,
              "bytes_data": 608, "unicode_state": 624, "unicode_length": 632,
              "ascii_data": 640, "sizeof": 760},
}


def cross_check_debug(debug):
    """Debug-offset positions against the reference document; mismatch lines."""
    out = []
    tables = dict(debug)
    tables[(3, 14)] = DEBUG_POSITIONS_314
    for ver, doc in sorted(REFERENCE_DEBUG.items()):
        if ver not in tables:
            continue
        for key, want in sorted(doc.items()):
            got = tables[ver].get(key, -1)
            if got != want:
                out.append("3.%d _Py_DebugOffsets %s: %d, reference doc %d"
                           % (ver[1], key, got, want))
    if set(DEBUG_POSITIONS_314) != set(DEBUG_KEYS):
        out.append("3.14 _Py_DebugOffsets positions incomplete")
    return out


def cross_check(offsets, extras):
    """Compare against the reference document; return a list of mismatch lines."""
    mismatches = []
    for ver, doc in sorted(REFERENCE_DOC.items()):
        if ver not in offsets:
            continue
        have = dict(offsets[ver])
        have.update(extras.get(ver, {}))
        for key, want in doc.items():
            got = have.get(key, -1)
            want = -1 if want is None else want
            if got != want:
                mismatches.append("3.%d %s: compiled %d, reference doc %d"
                                  % (ver[1], key, got, want))
    return mismatches


def render(offsets, sources, debug):
    lines = [
        "# Generated by `%s` -- DO NOT EDIT." % GENERATE_CMD,
        "# Regenerate with that command; verify with `%s --check`." % GENERATE_CMD,
        '"""CPython struct offsets and constants for x86_64 Linux (default GIL builds).',
        "",
        "OFFSETS: compiled offsetof()/sizeof() values, from gcc against the pyenv",
        "headers of the releases in COMPILED_FROM (3.15: Debian's libpython3.15-dev,",
        "in tools/build-chroot.sh's root).  -1 means the version has no such",
        "field.  Notes: tstate_cframe/cframe_current_frame are only given for 3.11",
        "and 3.12 (3.10 has a tstate->cframe, but it holds no frame pointer);",
        "owner_* are FRAME_OWNED_BY_* enum values, not offsets.  3.15 has no",
        "autoTSSkey (runtime_autotss -1: cpython/tls.py) and no CSTACK owner.",
        "",
        "OFFSETS_FROM_SOURCE: NOT compiled.  3.14 values transcribed from the",
        "project reference (cpython-frames.md, layouts computed from the v3.14.0",
        "sources), the autoTSSkey position from py-spy's bindgen of the v3.14.0",
        "headers (SOURCE_314_EXTRA in the generator); -1 where neither gives one.",
        "",
        "DEBUG_POSITIONS: where _Py_DebugOffsets (3.13+) publishes each value at",
        "run time; the loader reads them from the target and prefers them.",
        '"""',
        "",
        "KEYS = (",
    ]
    lines += ['    "%s",' % key for key in KEYS]
    lines += [")", "", "COMPILED_FROM = {"]
    for ver in sorted(sources):
        lines.append("    (%d, %d): %r," % (ver[0], ver[1], tuple(sources[ver])))
    lines += ["}", "", "OFFSETS = {"]

    def dump(table):
        for ver in sorted(table):
            lines.append("    (%d, %d): {" % ver)
            for key in KEYS:
                lines.append('        "%s": %d,' % (key, table[ver][key]))
            lines.append("    },")

    dump(offsets)
    lines += ["}", "", "# 3.14: from source, NOT compiled -- see the module docstring.",
              "OFFSETS_FROM_SOURCE = {"]
    dump({(3, 14): from_source_314()})
    lines += ["}", ""]

    def dump_debug(table):
        for ver in sorted(table):
            lines.append("    (%d, %d): {" % ver)
            for key in DEBUG_KEYS:
                lines.append('        "%s": %d,' % (key, table[ver][key]))
            lines.append("    },")

    lines += ["# Positions (bytes) of fields inside _Py_DebugOffsets, the struct at the",
              "# start of _PyRuntime from 3.13 on; keys are OFFSETS keys whose run-time",
              "# value CPython publishes there, plus version, free_threaded and sizeof.",
              "DEBUG_POSITIONS = {"]
    dump_debug(debug)
    lines += ["}", "", "# 3.14: from source, NOT compiled.", "DEBUG_POSITIONS_FROM_SOURCE = {"]
    dump_debug({(3, 14): DEBUG_POSITIONS_314})
    lines += ["}", ""]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="regenerate in memory; exit 1 if %s differs" % TABLE_PATH)
    ap.add_argument("--print", action="store_true", dest="print_",
                    help="print the generated module instead of writing it")
    args = ap.parse_args(argv)

    try:
        offsets, sources, extras, debug, problems = generate()
    except RuntimeError as exc:
        print("gen_offsets: %s" % exc, file=sys.stderr)
        return 2
    problems += cross_check(offsets, extras)
    problems += cross_check_debug(debug)
    if problems:
        print("gen_offsets: self-check FAILED:", file=sys.stderr)
        for line in problems:
            print("  " + line, file=sys.stderr)
        return 3
    missing = [m for m in list(range(MIN_MINOR, MAX_MINOR + 1)) + list(CHROOT_MINORS)
               if (3, m) not in offsets]
    if missing:
        print("gen_offsets: warning: no install for 3.%s"
              % ", 3.".join(str(m) for m in missing), file=sys.stderr)
    text = render(offsets, sources, debug)

    if args.print_:
        sys.stdout.write(text)
        return 0
    if args.check:
        try:
            with open(TABLE_PATH) as fh:
                old = fh.read()
        except OSError:
            old = ""
        if old != text:
            sys.stdout.writelines(difflib.unified_diff(
                old.splitlines(True), text.splitlines(True),
                "committed/" + os.path.relpath(TABLE_PATH, REPO), "generated"))
            print("gen_offsets: %s is out of date; run `%s`"
                  % (os.path.relpath(TABLE_PATH, REPO), GENERATE_CMD), file=sys.stderr)
            return 1
        print("gen_offsets: %s is up to date (%s)"
              % (os.path.relpath(TABLE_PATH, REPO),
                 ", ".join("3.%d" % v[1] for v in sorted(offsets))))
        return 0
    with open(TABLE_PATH, "w") as fh:
        fh.write(text)
    print("gen_offsets: wrote %s (%s)"
          % (os.path.relpath(TABLE_PATH, REPO),
             ", ".join("%s" % "/".join(sources[v]) for v in sorted(sources))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
