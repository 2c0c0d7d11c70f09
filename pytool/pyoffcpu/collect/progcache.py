"""The cache of what bcc compiled (see bpfload's doc): the key (the sha256
of everything the compile depends on), the entry files (written
atomically, checked when read), and the compile itself, with bcc, in a
child process whose memory leaves with it."""
from __future__ import annotations


import base64
import ctypes as ct
import hashlib
import importlib.util
import json
import os
import struct
from typing import Dict, Optional, Sequence

from .. import cachedir
from ..kernel import bpfdefs
from ..kernel.bpfsys import (BPF_MAP_TYPE_ARRAY_OF_MAPS, BpfError, INNER_SUFFIX, LD_IMM64, PSEUDO_MAP_FD,
                     PSEUDO_MAP_VALUE, map_info)

FORMAT = 2                              # 2: load-time constants (bpf/loadconst.h)
MAGIC = b"pyoffcpu-bpf-cache\n"
MAX_FILES = 32                          # entries kept (least recently used go first)


class CacheError(Exception):
    """A cache entry that cannot be used."""


# -- load-time constants (bpf/loadconst.h) -----------------------------------------------------------
LOADCONST_MAGIC = bpfdefs.value("LOADCONST_MAGIC")
LOADCONST_INDEX_MASK = bpfdefs.value("LOADCONST_INDEX_MASK")
LOAD_CONSTS = {i: name for name, i in bpfdefs.with_prefix("LC_").items()}     # index -> NAME


def load_const_at(code, j: int) -> Optional[str]:
    """The name of the load-time constant instruction j of code loads (an
    ld_imm64 of LOADCONST_MAGIC + its index, src_reg 0), or None."""
    if code[j * 8] != LD_IMM64 or code[j * 8 + 1] >> 4:
        return None
    lo, hi = struct.unpack_from("<I", code, j * 8 + 4)[0], struct.unpack_from("<I", code, j * 8 + 12)[0]
    value = hi << 32 | lo
    if value & ~LOADCONST_INDEX_MASK != LOADCONST_MAGIC:
        return None
    return LOAD_CONSTS.get(value & LOADCONST_INDEX_MASK)


# -- kfunc calls (bpf/loadconst.h task_u32): a helper call of a marker id, named here --------------
CALL = 0x85                             # BPF_JMP | BPF_CALL
PSEUDO_KFUNC_CALL = 2
KFUNC_MARKS = {bpfdefs.value("KFUNC_RDONLY_CAST"): "bpf_rdonly_cast"}    # marker id -> kfunc
KFUNC_PREFIX = "kfunc:"                 # load-time values: "kfunc:NAME" -> its BTF type id


def kfunc_at(code, j: int) -> Optional[str]:
    """The kfunc instruction j of code marks (a helper call of a marker
    id), or None."""
    if code[j * 8] != CALL or code[j * 8 + 1] >> 4:
        return None
    return KFUNC_MARKS.get(struct.unpack_from("<i", code, j * 8 + 4)[0])


def patch_kfuncs(code: bytearray, refs, values: Dict[str, int]) -> None:
    """Make each marked call a call of its kfunc (values: KFUNC_PREFIX +
    NAME -> its BTF type id in vmlinux).  A marker left as it is must be
    on a path the verifier never walks (KERNEL_CAST 0): raises CacheError
    for a kfunc without an id."""
    for j, name in refs:
        btf_id = values.get(KFUNC_PREFIX + name, 0)
        if not btf_id:
            raise CacheError(f"kfunc {name}: no BTF id given")
        code[j * 8 + 1] = (code[j * 8 + 1] & 0x0f) | (PSEUDO_KFUNC_CALL << 4)
        struct.pack_into("<hi", code, j * 8 + 2, 0, btf_id)


def patch_consts(code: bytearray, refs, values: Dict[str, int]) -> None:
    """Write each load-time constant's value (values: NAME -> int, two's
    complement for a negative one) into its ld_imm64.  Raises CacheError
    for one not given."""
    for j, name in refs:
        if name not in values:
            raise CacheError(f"load-time constant {name} not given")
        v = values[name] & ((1 << 64) - 1)
        struct.pack_into("<I", code, j * 8 + 4, v & 0xffffffff)
        struct.pack_into("<I", code, j * 8 + 12, v >> 32)


# -- the cache key ------------------------------------------------------------------------------------
def _stat_id(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return f"{path}:-"
    return f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


def _bcc_identity() -> str:
    """bcc's version and library, found without importing bcc (which maps LLVM)."""
    out = []
    try:
        spec = importlib.util.find_spec("bcc")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        d = list(spec.submodule_search_locations)[0]
        for name in ("version.py", "__init__.py", "libbcc.py"):
            out.append(_stat_id(os.path.join(d, name)))
        try:
            with open(os.path.join(d, "version.py")) as f:
                out.append(f.read().strip())
        except OSError:
            pass
    for d in ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib",
              "/usr/local/lib", "/usr/local/lib64"):
        lib = os.path.join(d, "libbcc.so.0")
        if os.path.exists(lib):
            out.append(_stat_id(lib))
            break
    return "\n".join(out)


def source_key(text: str, cflags: Sequence[str]) -> str:
    """The sha256 of the source of a compile of text with cflags: the text,
    the flags (an -I directory by its files, not its path: the package's
    bpf/ is the same files wherever it is installed), FORMAT.  The key of
    the entries shipped in the package (shipped_entry).  Not the kernel:
    what the programs need of it (its structs' offsets, what its
    tracepoints pass) is set at load time (bpf/loadconst.h), and the types
    they are compiled with are the kernel's user-space ABI (the tracepoint
    and perf-event context structs, `struct pt_regs` only by offsets),
    which a new kernel keeps.  An entry then serves every kernel the
    verifier accepts it on."""
    h = hashlib.sha256()

    def part(tag: str, data) -> None:
        data = data if isinstance(data, bytes) else str(data).encode()
        h.update(tag.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    part("format", FORMAT)
    part("text", text)
    for f in cflags:
        if not f.startswith("-I"):
            part("cflag", f)
            continue
        part("cflag", "-I")
        d = f[2:]
        for name in sorted(os.listdir(d)) if os.path.isdir(d) else ():
            p = os.path.join(d, name)
            if name.endswith((".h", ".c")) and os.path.isfile(p):
                with open(p, "rb") as fh:
                    part("include " + name, fh.read())
    return h.hexdigest()


def cache_key(text: str, cflags: Sequence[str]) -> str:
    """The key of this machine's cache entries: the source's (source_key)
    and the bcc that compiled it."""
    h = hashlib.sha256(source_key(text, cflags).encode() + b"\0")
    h.update(_bcc_identity().encode())
    return h.hexdigest()


# -- the entries shipped in the package (make bpf-objects) --------------------------------------------
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bpfobj")
MAX_SHIPPED_BYTES = 16 << 20


def shipped_path(key: str, directory: Optional[str] = None) -> str:
    return os.path.join(directory or SHIPPED_DIR, key + ".bpf")


def shipped_entry(text: str, cflags: Sequence[str], directory: Optional[str] = None) -> Optional[dict]:
    """The package's compile of text with cflags (tools/build_bpf_objects.py
    made it from bpf/ when the package was built), or None: none for this
    source (a tree whose bpf/ changed since, or flags no build ships).
    Raises CacheError for one that is there and cannot be used.  Read like
    the rest of the package's files: whoever can write them runs this code."""
    path = shipped_path(source_key(text, cflags), directory)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SHIPPED_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CacheError(f"{path}: unreadable ({e.strerror})") from None
    if len(data) > MAX_SHIPPED_BYTES:
        raise CacheError(f"{path}: over {MAX_SHIPPED_BYTES >> 20} MiB")
    try:
        return parse(data, os.path.basename(path)[:-4])
    except CacheError as e:
        raise CacheError(f"{path}: {e}") from None


# -- cache files --------------------------------------------------------------------------------------
def default_cache_dir() -> Optional[str]:
    return cachedir.cache_dir("bpf")


safe_dir = cachedir.safe_dir


def serialize(entry: dict) -> bytes:
    body = json.dumps(entry, separators=(",", ":"), sort_keys=True).encode()
    head = f"{FORMAT} {hashlib.sha256(body).hexdigest()} {len(body)}\n".encode()
    return MAGIC + head + body


def parse(data: bytes, key: Optional[str] = None) -> dict:
    """The entry in data, checked whole (raises CacheError)."""
    if not data.startswith(MAGIC):
        raise CacheError("not a pyoffcpu BPF cache file" if data else "empty")
    head, sep, body = data[len(MAGIC):].partition(b"\n")
    fields = head.split()
    if not sep or len(fields) != 3:
        raise CacheError("truncated header")
    if fields[0] != str(FORMAT).encode():
        raise CacheError(f"format {fields[0].decode(errors='replace')}, not {FORMAT}")
    try:
        size = int(fields[2])
    except ValueError:
        raise CacheError("corrupt header") from None
    if len(body) != size:
        raise CacheError(f"truncated ({len(body)} of {size} bytes)" if len(body) < size
                         else "longer than its header says")
    if hashlib.sha256(body).hexdigest().encode() != fields[1]:
        raise CacheError("checksum mismatch")
    try:
        entry = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise CacheError(f"corrupt ({e})") from None
    check_entry(entry, key)
    return entry


def check_entry(entry, key: Optional[str]) -> None:
    """The entry's shape, every map reference included (a program is only
    ever patched where bcc put a map's fd)."""
    try:
        if key is not None and entry["key"] != key:
            raise CacheError("made for another key")
        maps = {}
        for m in entry["maps"]:
            for f in ("type", "key_size", "value_size", "max_entries", "flags"):
                if not isinstance(m[f], int) or m[f] < 0:
                    raise CacheError(f"map {m.get('name')}: bad {f}")
            if not isinstance(m["name"], str) or not isinstance(m["key_desc"], str) \
                    or not isinstance(m["leaf_desc"], str):
                raise CacheError("bad map")
            maps[m["name"]] = m
        for m in entry["maps"]:
            inner = m.get("inner")
            if (m["type"] == BPF_MAP_TYPE_ARRAY_OF_MAPS) != (inner is not None) or (
                    inner is not None and (inner not in maps or maps[inner].get("inner"))):
                raise CacheError(f"map {m['name']}: bad inner map")
        if not isinstance(entry["license"], str) or not isinstance(entry.get("kern_version", 0), int):
            raise CacheError("bad license")
        for p in entry["programs"]:
            code = base64.b64decode(p["insns"], validate=True)
            if not code or len(code) % 8:
                raise CacheError(f"program {p['name']}: {len(code)} bytes of instructions")
            n = len(code) // 8
            for idx, mname in p["maps"]:
                if mname not in maps or not isinstance(idx, int) or not 0 <= idx < n - 1:
                    raise CacheError(f"program {p['name']}: bad map reference")
                op, regs = code[idx * 8], code[idx * 8 + 1]
                if op != LD_IMM64 or regs >> 4 not in (PSEUDO_MAP_FD, PSEUDO_MAP_VALUE):
                    raise CacheError(f"program {p['name']}: map reference at no map load")
            for idx, name in p["consts"]:
                if not isinstance(idx, int) or not 0 <= idx < n - 1 or load_const_at(code, idx) != name:
                    raise CacheError(f"program {p['name']}: a load-time constant at no such load")
            for idx, name in p.get("kfuncs", ()):
                if not isinstance(idx, int) or not 0 <= idx < n or kfunc_at(code, idx) != name:
                    raise CacheError(f"program {p['name']}: a kfunc at no marked call")
    except CacheError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CacheError(f"malformed ({type(e).__name__}: {e})") from None


def read_entry(path: str, key: str) -> Optional[dict]:
    """None: no entry.  Raises CacheError for one that cannot be used."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CacheError(f"unreadable ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise CacheError("not ours, or writable by others")
        with os.fdopen(fd, "rb") as f:
            fd = -1
            data = f.read()
    except OSError as e:
        raise CacheError(f"unreadable ({e.strerror})") from None
    finally:
        if fd >= 0:
            os.close(fd)
    entry = parse(data, key)
    try:
        os.utime(path)                  # recently used: kept by _prune
    except OSError:
        pass
    return entry


def write_entry(directory: str, path: str, entry: dict) -> None:
    if not cachedir.write_private(path, serialize(entry)):
        return
    try:
        names = [n for n in os.listdir(directory) if n.endswith(".bpf")]
        if len(names) > MAX_FILES:
            names.sort(key=lambda n: os.stat(os.path.join(directory, n)).st_mtime)
            for n in names[:len(names) - MAX_FILES]:
                os.unlink(os.path.join(directory, n))
    except OSError:
        pass


# -- compiling with bcc ---------------------------------------------------------------------------------
def compile_entry(text: str, cflags: Sequence[str]) -> dict:
    """bcc's compile of text (clang), as an entry: every function's
    instructions with its map references named, every map's attributes and
    type descriptions.  Imports bcc (LLVM): run it in a child process."""
    import bcc
    from bcc import libbcc
    lib = libbcc.lib
    for fn, res, args in (("bpf_num_tables", ct.c_size_t, [ct.c_void_p]),
                          ("bpf_table_name", ct.c_char_p, [ct.c_void_p, ct.c_size_t]),
                          ("bpf_table_fd_id", ct.c_int, [ct.c_void_p, ct.c_size_t]),
                          ("bpf_table_key_desc_id", ct.c_char_p, [ct.c_void_p, ct.c_size_t]),
                          ("bpf_table_leaf_desc_id", ct.c_char_p, [ct.c_void_p, ct.c_size_t])):
        getattr(lib, fn).restype = res
        getattr(lib, fn).argtypes = args
    class CompileOnly(bcc.BPF):
        def _trace_autoload(self):
            """Compile only: the caller loads and attaches (bcc.BPF would load
            and attach the raw_tracepoint__ functions here)."""
    b = CompileOnly(text=text.encode(), cflags=list(cflags))
    try:
        return _dump(b, lib)
    finally:
        b.cleanup()


def _dump(b, lib) -> dict:
    mod = b.module
    maps, by_fd = [], {}
    for i in range(lib.bpf_num_tables(mod)):
        name = lib.bpf_table_name(mod, i).decode()
        fd = lib.bpf_table_fd_id(mod, i)
        mtype, ks, vs, me, flags, _ = map_info(fd)
        maps.append({"name": name, "type": mtype, "key_size": ks, "value_size": vs,
                     "max_entries": me, "flags": flags,
                     "key_desc": (lib.bpf_table_key_desc_id(mod, i) or b"").decode(),
                     "leaf_desc": (lib.bpf_table_leaf_desc_id(mod, i) or b"").decode()})
        by_fd[fd] = name
    names = {m["name"] for m in maps}
    for m in maps:                      # bcc gives no name of an array of maps' template
        if m["type"] == BPF_MAP_TYPE_ARRAY_OF_MAPS:
            m["inner"] = m["name"] + INNER_SUFFIX
            if m["inner"] not in names:
                raise BpfError(f"array of maps {m['name']}: its template must be named {m['inner']}")
    progs = []
    for i in range(lib.bpf_num_functions(mod)):
        fname = lib.bpf_function_name(mod, i)
        code = bytearray(b.dump_func(fname))
        refs = []
        for j in range(len(code) // 8):
            op, regs = code[j * 8], code[j * 8 + 1]
            if op == LD_IMM64 and regs >> 4:
                imm = struct.unpack_from("<i", code, j * 8 + 4)[0]
                if regs >> 4 not in (PSEUDO_MAP_FD, PSEUDO_MAP_VALUE) or imm not in by_fd:
                    raise BpfError(f"{fname.decode()}: an ld_imm64 (src_reg {regs >> 4}) that is "
                                   "no map of this module")
                refs.append([j, by_fd[imm]])
                # the fd is this compile's (the loader writes its own): 0, so
                # that a compile is the same bytes whatever fds were open
                struct.pack_into("<i", code, j * 8 + 4, 0)
        consts = [[j, name] for j in range(len(code) // 8 - 1)
                  for name in [load_const_at(code, j)] if name]
        kfuncs = [[j, name] for j in range(len(code) // 8) for name in [kfunc_at(code, j)] if name]
        progs.append({"name": fname.decode(), "insns": base64.b64encode(bytes(code)).decode(),
                      "maps": refs, "consts": consts, "kfuncs": kfuncs})
    return {"format": FORMAT, "license": lib.bpf_module_license(mod).decode(),
            "kern_version": int(lib.bpf_module_kern_version(mod)), "maps": maps,
            "programs": progs}


def one_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else type(e).__name__


def compile_in_child(text: str, cflags: Sequence[str]) -> dict:
    """compile_entry in a forked child: clang's hundred-odd MiB never enter
    this process.  bcc's own diagnostics go to stderr as before."""
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        return compile_entry(text, cflags)
    if pid == 0:                                        # the child
        status = 1
        try:
            os.close(r)
            try:
                out = b"K" + json.dumps(compile_entry(text, cflags)).encode()
            except BaseException as e:                  # noqa: BLE001 (reported to the parent)
                out = b"E" + (one_line(e) if not isinstance(e, ImportError)
                              else "bcc (python3-bpfcc) is not installed").encode()
            view = memoryview(out)
            while view:
                view = view[os.write(w, view):]
            status = 0
        finally:
            os._exit(status)
    os.close(w)
    chunks = []
    try:
        while True:
            chunk = os.read(r, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        _, st = os.waitpid(pid, 0)
    data = b"".join(chunks)
    if data[:1] == b"E":
        raise BpfError(data[1:].decode(errors="replace"))
    if data[:1] != b"K":
        why = (f"signal {os.WTERMSIG(st)}" if os.WIFSIGNALED(st)
               else f"status {os.waitstatus_to_exitcode(st)}")
        raise BpfError(f"the BPF compiler (bcc) ended with {why}")
    return json.loads(data[1:])
