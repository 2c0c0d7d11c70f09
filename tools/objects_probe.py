"""Finds where one CPython build keeps what a reader of plain objects needs:
sys.modules, a module's dict, an instance's attributes, a code object's
argument counts and local names, a frame's locals.

Run by tools/gen_object_layouts.py under each interpreter (pyenv 3.7-3.13,
Debian's 3.11, the chroot's 3.14/3.15): it builds objects of known content
and looks, through ctypes, at which word of each holds what.  Only memory
known to be an object (an id(), or a pointer just found in one) is read.
Prints one JSON object; a field that is not pinned down exactly once is an
error, not a guess.  Kept to the Python 3.7 subset.
"""
import ctypes
import gc
import json
import sys

W = 8
V = sys.version_info[:2]


def word(addr):
    return ctypes.c_uint64.from_address(addr).value


def i32(addr):
    return ctypes.c_int32.from_address(addr).value


def find(base, nbytes, value, start=0):
    return [off for off in range(start, nbytes, W) if word(base + off) == value]


def one(name, hits):
    if len(hits) != 1:
        raise SystemExit("%s: %d candidates %r" % (name, len(hits), hits))
    return hits[0]


def probe_class():
    class Probe(object):       # qualname `probe_class.<locals>.Probe`, not its name
        pass
    return Probe


Probe = probe_class()


def f_small(a, b, c, *, d):
    x = b                      # a cell: the inner function uses it

    def inner():
        return x
    return a, inner, c, d


def f_large(a, b, *, c, d, e):
    y = a
    z = b
    return y, z, c, d, e


def main():
    out = {"version": list(sys.version_info[:3]), "debug": hasattr(sys, "gettotalrefcount")}
    if getattr(sys, "_is_gil_enabled", lambda: True)() is False or \
            "free-threading" in sys.version:
        raise SystemExit("a free-threaded build: not probed")
    out["object_type"] = one("object_type", find(id(out), 32, id(dict)))

    # -- sys.modules and a module's dict ----------------------------------------------
    api = ctypes.pythonapi
    api.PyInterpreterState_Head.restype = ctypes.c_void_p
    interp = api.PyInterpreterState_Head()
    out["interp_modules"] = min(find(interp, 1 << 16, id(sys.modules)))
    out["module_dict"] = one("module_dict", find(id(json), type(json).__basicsize__,
                                                 id(json.__dict__)))

    # -- a dict: its keys object and (split) values -----------------------------------
    d = {"probe_k%d" % i: i for i in range(5)}
    out["dict_used"] = one("dict_used", [o for o in find(id(d), 48, 5) if o >= 16])
    keys = word(id(d) + 32)
    out["dict_keys"], out["dict_values"] = 32, 40
    if word(id(d) + 40) != 0:
        raise SystemExit("a combined dict has values")
    k0 = id(list(d)[0])
    hits = find(keys, 512, k0)
    if not hits:
        raise SystemExit("dict keys: first key not found")
    # entries: {hash, key, value} (3.7-3.10, and 3.11+'s general keys) or {key, value}
    out["dict_entries"] = hits[0] - (W if V < (3, 11) else 0)
    if V < (3, 11):
        out["dict_keys_size"], out["dict_keys_nentries"], out["dict_keys_indices"] = 8, 32, 40
        if word(keys + 8) != 8 or word(keys + 32) != 5:
            raise SystemExit("3.7-3.10 keys layout")
    else:
        out["dict_keys_nentries"], out["dict_keys_indices"] = 24, 32
        blob = ctypes.string_at(keys, 16)
        if blob[8] != 3 or blob[10] != 1 or word(keys + 24) != 5:     # 8 slots, unicode keys
            raise SystemExit("3.11+ keys layout: %r" % blob)

    # -- an instance's attributes, untouched (split values) and materialised ---------
    fresh = Probe()
    fresh.probe_alpha = marker_a = object()
    fresh.probe_beta = marker_b = object()
    tp = type(fresh)
    out["type_basicsize"] = one("type_basicsize", find(id(tp), 64, tp.__basicsize__))
    out["type_flags"] = 168
    out["type_dictoffset"] = 288
    if word(id(tp) + 168) != tp.__flags__ or i32(id(tp) + 288) != tp.__dictoffset__:
        raise SystemExit("tp_flags / tp_dictoffset moved")
    out["type_name"] = 24
    qual = one("ht_qualname", find(id(tp), type(tp).__basicsize__, id(tp.__qualname__), 296))
    out["heaptype_cached_keys"] = qual + W
    cached = word(id(tp) + qual + W)
    if V >= (3, 11) and not cached:
        raise SystemExit("no cached keys")
    if cached and not find(cached, 512, id("probe_alpha")):
        raise SystemExit("ht_cached_keys does not list the attributes")
    base = id(fresh)
    if V < (3, 11):
        out["inst_kind"] = "dictoffset"
        if word(base + tp.__dictoffset__) != id(fresh.__dict__):
            raise SystemExit("instance dict not at tp_dictoffset")
    elif V < (3, 13):
        # 3.11: a values pointer at -32; 3.12: a dict-or-values word at -24,
        # tagged (odd: it holds the values' address - 1)
        hits = [(o, tag) for o in (-32, -24) for tag in (0, 1)
                if (word(base + o) & 1) == tag and word(base + o) > 4096
                and word(word(base + o) + tag + W) == id(marker_b)]
        o, tag = one("instance values", hits)
        out["inst_kind"], out["inst_values"], out["inst_tag"], out["values_items"] = \
            "pointer", o, tag, 0
    else:
        hits = find(base + tp.__basicsize__, 64, id(marker_a))
        out["inst_kind"], out["inst_values"] = "inline", 0
        out["values_items"] = one("inline values", hits)
        out["inst_dict"] = -24
    if V >= (3, 11):
        touched = Probe()
        touched.probe_alpha = 1
        dd = touched.__dict__
        out["inst_dict"] = one("managed dict", [o for o in (-24, -32) if word(id(touched) + o) == id(dd)])
        if V >= (3, 13):
            # a materialised dict that shares the inline values keeps them
            pass

    # -- containers and numbers ----------------------------------------------------------
    m1, m2 = object(), object()
    t = (m1, m2)
    out["var_size"] = one("ob_size", find(id(t), 48, 2))
    out["tuple_items"] = one("tuple ob_item", find(id(t), 64, id(m1)))
    lst = [m1, m2, None]
    arr = one("list ob_item", [o for o in range(16, type(lst).__basicsize__, W) if word(id(lst) + o) > 4096
                               and o != out["object_type"] and word(word(id(lst) + o)) == id(m1)])
    out["list_items"] = arr
    st = set(range(100, 140))
    out["set_used"], out["set_mask"], out["set_table"] = 24, 32, 40
    if word(id(st) + 24) != len(st) or not any(word(word(id(st) + 40) + 16 * i) == id(120)
                                               for i in range(word(id(st) + 32) + 1)):
        raise SystemExit("set layout")
    fl = 1.5
    out["float_value"] = one("ob_fval", [o for o in range(16, 32, W)
                                         if ctypes.c_double.from_address(id(fl) + o).value == 1.5])
    big = (1 << 60) + 5
    out["long_digits"] = 24
    digits = [ctypes.c_uint32.from_address(id(big) + 24 + 4 * i).value for i in range(3)]
    if digits != [5, 0, 1]:
        raise SystemExit("int digits: %r" % digits)
    # 3.7-3.11: ob_size, the digit count with the sign; 3.12+: lv_tag, count << 3 | sign
    tag, neg = word(id(big) + 16), -big
    sign = word(id(neg) + 16) & 0xff
    out["long_tagged"] = tag == 3 << 3
    if tag not in (3, 3 << 3) or sign not in (0xfd, 3 << 3 | 2):
        raise SystemExit("int size: %#x" % tag)
    s1 = "probe-ascii"
    out["str_length"] = one("str length", [o for o in (16,) if word(id(s1) + o) == len(s1)])
    out["bytes_size"] = 16
    b1 = b"probe-bytes!"
    out["bytes_data"] = one("bytes data", [o for o in range(24, 48, W)
                                           if ctypes.string_at(id(b1) + o, len(b1)) == b1])
    cell = f_small.__code__.co_consts and (lambda: m1).__closure__[0]
    out["cell_ref"] = one("cell ob_ref", find(id(cell), 32, id(m1)))

    # -- code objects: argument counts, flags, local names -------------------------------
    cs, cl = f_small.__code__, f_large.__code__
    size = min(type(cs).__basicsize__, 256)

    def int_field(name, a, b):
        return one(name, [o for o in range(16, size, 4) if i32(id(cs) + o) == a and i32(id(cl) + o) == b])
    out["code_argcount"] = int_field("co_argcount", 3, 2)
    out["code_kwonlyargcount"] = int_field("co_kwonlyargcount", 1, 3)
    flags = [o for o in range(16, size, 4)
             if i32(id(cs) + o) == cs.co_flags and i32(id(cl) + o) == cl.co_flags]
    out["code_flags"] = flags[0]
    if V < (3, 11):
        inner = cs.co_consts[[type(c).__name__ for c in cs.co_consts].index("code")]
        out["code_varnames"] = one("co_varnames", find(id(cs), size, id(cs.co_varnames)))
        out["code_cellvars"] = one("co_cellvars", find(id(cs), size, id(cs.co_cellvars)))
        out["code_freevars"] = one("co_freevars", find(id(inner), size, id(inner.co_freevars)))
        out["code_nlocals"] = int_field("co_nlocals", 5, 7)
        out["code_localsplusnames"] = -1
    else:
        # co_localsplusnames, co_localspluskinds, then co_filename (3.11-3.15)
        at = one("co_filename", find(id(cs), size, id(cs.co_filename))) - 2 * W
        names = cs.co_varnames + cs.co_cellvars + cs.co_freevars
        tup = word(id(cs) + at)
        items = out["tuple_items"]
        if word(tup + W) != id(tuple) or word(tup + 2 * W) != len(names) or \
                [word(tup + items + W * i) for i in range(len(names))] != [id(n) for n in names]:
            raise SystemExit("co_localsplusnames not before co_localspluskinds, co_filename")
        out["code_localsplusnames"] = at
        out["code_varnames"] = out["code_cellvars"] = out["code_freevars"] = -1
        out["code_nlocals"] = -1

    # -- a frame's locals -----------------------------------------------------------------
    def at(first, second):
        f = sys._getframe()
        return f, first, second
    m1, m2 = object(), object()
    frame, _, _ = at(m1, m2)
    # 3.7-3.10: PyFrameObject.f_localsplus; 3.11+: the interpreter frame's
    # (PyFrameObject.f_frame, after ob_base and f_back)
    where = id(frame) if V < (3, 11) else word(id(frame) + 24)
    out["frame_localsplus"] = min(o for o in find(where, type(frame).__basicsize__ + 128, id(m1))
                                  if word(where + o + W) == id(m2))
    if word(where + out["frame_localsplus"] + W) != id(m2):
        raise SystemExit("localsplus: second local")
    # -- the cyclic collector's `collecting` flag ------------------------------------------
    # 3.9+: in the interpreter's struct _gc_runtime_state; 3.7/3.8 in _PyRuntime's
    if V >= (3, 9):
        out["gc_base"], base = "interp", interp
    else:
        out["gc_base"] = "runtime"
        base = ctypes.addressof(ctypes.c_char.in_dll(api, "_PyRuntime"))
    span = 1 << (16 if out["gc_base"] == "interp" else 12)     # _PyRuntime may end a mapping
    seen = []

    def during(phase, info):
        if phase == "start":
            seen.append([i32(base + o) for o in range(0, span, 4)])
    outside = [i32(base + o) for o in range(0, span, 4)]
    gc.callbacks.append(during)
    try:
        gc.collect()
        gc.collect()
    finally:
        gc.callbacks.remove(during)
    after = [i32(base + o) for o in range(0, span, 4)]
    flips = [4 * i for i in range(span // 4)
             if outside[i] == 0 and after[i] == 0 and all(x[i] == 1 for x in seen)]
    out["gc_collecting"] = min(flips) if flips else -1
    if not flips:
        raise SystemExit("gc collecting: not found")
    print(json.dumps(out, sort_keys=True))


main()
