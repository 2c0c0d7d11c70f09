#!/usr/bin/env python3
"""Measure two glibc ``struct pthread`` offsets on this machine (x86_64).

Usage::

    /usr/bin/python3 tools/check_glibc_offsets.py [--threads N] [--json]

The eBPF side needs, for a task whose TLS base is ``fsbase`` (== ``pthread_self()``
on x86_64 glibc):

1. ``offsetof(struct pthread, tid)`` -- where the kernel TID sits, used to map a
   ``pthread_t`` (CPython <= 3.10 ``tstate->thread_id``) to a TID.  Checked by
   finding ``gettid()`` at ``pthread_self() + OFF`` in every thread; the expected
   value, 0x2d0, is confirmed when it is the (unique) candidate.
2. ``offsetof(struct pthread, specific_1stblock)`` -- the inline array of
   ``struct pthread_key_data { uintptr_t seq; void *data; }`` for keys 0..31,
   so that ``pthread_getspecific(key)`` (CPython's autoTSSkey) can be emulated as
   ``*(fsbase + OFF + key*16 + 8)``.  Measured by creating keys (only our own
   keys are written, never CPython's), ``pthread_setspecific(key, MAGIC)`` with a
   distinct MAGIC per thread and key, and searching for the one OFF where every
   key 0..31 created by us reads back its MAGIC in every thread; the ``seq``
   word next to it must be odd (key in use) and keys we did not set must agree
   with ``pthread_getspecific``.

Also checks ``pthread_self() == fs_base`` (``arch_prctl(ARCH_GET_FS)``).
Exits 0 when everything is consistent, 1 otherwise.  Linux x86_64 + glibc only.
"""

import argparse
import ctypes
import json
import os
import platform
import sys
import threading

ARCH_GET_FS = 0x1003
SYS_arch_prctl = 158  # x86_64
SYS_gettid = 186      # x86_64
KEY_DATA_SIZE = 16    # struct pthread_key_data
FIRSTLEVEL = 32       # PTHREAD_KEY_2NDLEVEL_SIZE: keys in specific_1stblock
SCAN_LIMIT = 0x1000   # search window for the offsets (struct pthread is ~2.3 KiB)
EXPECTED_TID_OFF = 0x2D0

libc = ctypes.CDLL(None, use_errno=True)
libc.pthread_self.restype = ctypes.c_ulong
libc.pthread_key_create.argtypes = [ctypes.POINTER(ctypes.c_uint), ctypes.c_void_p]
libc.pthread_key_delete.argtypes = [ctypes.c_uint]
libc.pthread_setspecific.argtypes = [ctypes.c_uint, ctypes.c_void_p]
libc.pthread_getspecific.argtypes = [ctypes.c_uint]
libc.pthread_getspecific.restype = ctypes.c_void_p
libc.syscall.restype = ctypes.c_long
libc.gnu_get_libc_version.restype = ctypes.c_char_p


def gettid():
    return libc.syscall(SYS_gettid)


def fs_base():
    val = ctypes.c_ulong()
    if libc.syscall(SYS_arch_prctl, ARCH_GET_FS, ctypes.byref(val)) != 0:
        raise OSError(ctypes.get_errno(), "arch_prctl(ARCH_GET_FS)")
    return val.value


def u64(addr):
    return ctypes.c_uint64.from_address(addr).value


def readable_span(addr):
    """Bytes readable from ``addr`` on (contiguous readable mappings), capped."""
    regions = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            rng, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in rng.split("-"))
            regions.append((lo, hi, perms[0] == "r"))
    regions.sort()
    end = None
    for lo, hi, readable in regions:
        if end is None:
            if lo <= addr < hi and readable:
                end = hi
        elif lo == end and readable:
            end = hi
        elif lo >= end:
            break
    return min(SCAN_LIMIT, (end or addr) - addr)


def autotss_check(block):
    """If this is CPython and pyoffcpu's offsets table knows it, emulate
    pthread_getspecific(autoTSSkey) from ``block`` (specific_1stblock) and
    compare with PyThreadState_Get().  Returns None when not applicable."""
    try:
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        sys.path.insert(0, os.path.join(repo, "pytool"))
        from pyoffcpu.cpython.offsets_table import OFFSETS
        offs = OFFSETS[sys.version_info[:2]]
        api = ctypes.pythonapi
        rt = ctypes.addressof(ctypes.c_char.in_dll(api, "_PyRuntime"))
    except Exception:
        return None
    tss = rt + offs["runtime_autotss"]
    if not ctypes.c_int32.from_address(tss + offs["tss_is_initialized"]).value:
        return None
    key = ctypes.c_uint32.from_address(tss + offs["tss_key"]).value
    if key >= FIRSTLEVEL:
        return None
    api.PyThreadState_Get.restype = ctypes.c_void_p
    return [key, u64(block + key * KEY_DATA_SIZE + 8) == api.PyThreadState_Get()]


def create_keys():
    """Create keys until every key number < 32 that was free is ours."""
    ours = []
    while True:
        k = ctypes.c_uint()
        if libc.pthread_key_create(ctypes.byref(k), None) != 0:
            raise OSError("pthread_key_create failed")
        if k.value >= FIRSTLEVEL:
            libc.pthread_key_delete(k.value)
            return ours
        ours.append(k.value)


def magic(tindex, key):
    return 0x5EC1F1C000000000 | (tindex << 16) | (key << 4) | 0x8


def measure_thread(tindex, keys, out, barrier):
    try:
        self_ = libc.pthread_self()
        tid = gettid()
        rec = {"tindex": tindex, "pthread_self": self_, "fs_base": fs_base(), "tid": tid}
        limit = readable_span(self_)
        rec["scanned"] = limit
        # (a) TID candidates.
        rec["tid_offsets"] = [off for off in range(0, limit - 3, 4)
                              if ctypes.c_int32.from_address(self_ + off).value == tid]
        # (b) specific_1stblock candidates.
        for k in keys:
            if libc.pthread_setspecific(k, magic(tindex, k)) != 0:
                raise OSError("pthread_setspecific(%d) failed" % k)
        cands = []
        for off in range(0, limit - FIRSTLEVEL * KEY_DATA_SIZE + 1, 8):
            if all(u64(self_ + off + k * KEY_DATA_SIZE + 8) == magic(tindex, k)
                   for k in keys):
                cands.append(off)
        rec["specific_offsets"] = cands
        if cands:
            off = cands[0]
            rec["seq_odd"] = all(u64(self_ + off + k * KEY_DATA_SIZE) & 1 for k in keys)
            # Every key 0..31 (ours or not) must agree with pthread_getspecific.
            rec["getspecific_agrees"] = all(
                u64(self_ + off + k * KEY_DATA_SIZE + 8) == (libc.pthread_getspecific(k) or 0)
                for k in range(FIRSTLEVEL))
            rec["foreign_nonnull_keys"] = [
                k for k in range(FIRSTLEVEL)
                if k not in keys and libc.pthread_getspecific(k)]
            rec["autotss"] = autotss_check(self_ + off)
        for k in keys:
            libc.pthread_setspecific(k, None)
        out.append(rec)
    finally:
        if barrier is not None:
            barrier.wait()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=8, help="extra threads (default 8)")
    ap.add_argument("--json", action="store_true", help="print the raw records as JSON")
    args = ap.parse_args(argv)

    if platform.machine() != "x86_64" or not sys.platform.startswith("linux"):
        print("only Linux x86_64 is supported", file=sys.stderr)
        return 2

    keys = create_keys()
    records = []
    try:
        # Keep all threads alive until every one has measured, so that the
        # struct pthread blocks are distinct.
        barrier = threading.Barrier(args.threads)
        threads = [threading.Thread(target=measure_thread, args=(i + 1, keys, records, barrier))
                   for i in range(args.threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        measure_thread(0, keys, records, None)
    finally:
        for k in keys:
            libc.pthread_key_delete(k)

    ok = True
    nthreads = len(records)
    tid_common = set.intersection(*(set(r["tid_offsets"]) for r in records))
    spec_common = set.intersection(*(set(r["specific_offsets"]) for r in records))
    fs_ok = all(r["pthread_self"] == r["fs_base"] for r in records)
    seq_ok = all(r.get("seq_odd") for r in records)
    agree_ok = all(r.get("getspecific_agrees") for r in records)

    print("glibc %s, Python %s, %d threads, keys created by us: %s"
          % (libc.gnu_get_libc_version().decode(), platform.python_version(),
             nthreads, keys))
    print("pthread_self() == fs_base in every thread: %s" % fs_ok)
    ok &= fs_ok
    if len(tid_common) == 1:
        off = tid_common.pop()
        print("offsetof(struct pthread, tid) = %#x (%d), found in %d/%d threads%s"
              % (off, off, nthreads, nthreads,
                 "" if off == EXPECTED_TID_OFF else "  [EXPECTED %#x]" % EXPECTED_TID_OFF))
        ok &= off == EXPECTED_TID_OFF
    else:
        print("offsetof(struct pthread, tid): ambiguous/not found: %s"
              % sorted(hex(o) for o in tid_common))
        ok = False
    if len(spec_common) == 1 and len(keys) > 0:
        off = spec_common.pop()
        print("offsetof(struct pthread, specific_1stblock) = %#x (%d): "
              "data of key k at pthread_self()+%#x+k*16+8, keys %d..%d checked in %d/%d "
              "threads; seq odd: %s; all 32 slots agree with pthread_getspecific: %s"
              % (off, off, off, min(keys), max(keys), nthreads, nthreads, seq_ok, agree_ok))
        ok &= seq_ok and agree_ok
        foreign = sorted(set().union(*(r.get("foreign_nonnull_keys", []) for r in records)))
        print("  keys not ours with non-NULL data (read back correctly too): %s" % foreign)
        tss = [r.get("autotss") for r in records]
        if all(t is not None for t in tss):
            good = all(t[1] for t in tss)
            print("  CPython autoTSSkey = %d: fsbase+%#x+key*16+8 == PyThreadState_Get() "
                  "in %d/%d threads" % (tss[0][0], off, sum(t[1] for t in tss), nthreads))
            ok &= good
    else:
        print("offsetof(struct pthread, specific_1stblock): ambiguous/not found: %s"
              % sorted(hex(o) for o in spec_common))
        ok = False
    if args.json:
        print(json.dumps(records, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
