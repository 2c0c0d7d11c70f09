"""Finds where one CPython build keeps what an asyncio task reader needs.

Run by tools/gen_asyncio_offsets.py under each interpreter (pyenv 3.11-3.13,
the chroot's 3.14/3.15): it builds tasks, futures and coroutines in known
states and looks, through ctypes, at which word of each object holds what.
Nothing here is read from headers, so a private struct (TaskObj lives in
Modules/_asynciomodule.c) is measured, not transcribed.  Prints one JSON
object; a field it cannot pin down exactly once is an error, not a guess.
Kept to the Python 3.7 subset every probed interpreter runs.
"""
import asyncio
import ctypes
import json
import sys
import types
import weakref

W = 8


def word(addr):
    return ctypes.c_uint64.from_address(addr).value


def i32(addr):
    return ctypes.c_int32.from_address(addr).value


def i8(addr):
    return ctypes.c_int8.from_address(addr).value


def find(base, nbytes, value, mask=~0):
    return [off for off in range(0, nbytes, W) if word(base + off) & mask == value]


def one(name, hits):
    if len(hits) != 1:
        raise SystemExit("%s: %d candidates %r" % (name, len(hits), hits))
    return hits[0]


def main():
    out = {"version": list(sys.version_info[:3]),
           "debug": hasattr(sys, "gettotalrefcount")}
    loop = asyncio.new_event_loop()
    Task = asyncio.Task
    out["c_task"] = Task.__module__ == "_asyncio"
    if not out["c_task"]:
        raise SystemExit("no C _asyncio Task")

    # -- the task: coro, name, fut_waiter, loop ---------------------------------
    fut = loop.create_future()

    async def waiter(f):
        await f

    coro = waiter(fut)
    name = "probe-%d" % id(fut)
    task = loop.create_task(coro, name=name)
    loop.run_until_complete(asyncio.sleep(0.01))
    size = type(task).__basicsize__
    out["task_size"] = size
    out["task_coro"] = one("task_coro", find(id(task), size, id(coro)))
    out["task_name"] = one("task_name", find(id(task), size, id(task.get_name())))
    out["task_fut_waiter"] = one("task_fut_waiter", find(id(task), size, id(fut)))
    out["fut_loop"] = one("fut_loop", find(id(task), size, id(loop)))

    # -- a future's state: PENDING -> FINISHED ------------------------------------
    f2 = loop.create_future()
    fsize = type(f2).__basicsize__
    before = [i32(id(f2) + o) for o in range(0, fsize, 4)]
    f2.set_result(None)
    after = [i32(id(f2) + o) for o in range(0, fsize, 4)]
    states = [4 * i for i, (a, b) in enumerate(zip(before, after)) if a == 0 and b == 2]
    out["fut_state"] = one("fut_state", states)
    out["fut_pending"], out["fut_finished"] = 0, 2

    # -- the coroutine's frame, its state and its stack top ------------------------
    out["gen_iframe"] = word(id(coro.cr_frame) + 3 * W) - id(coro)
    if not 0 < out["gen_iframe"] < type(coro).__basicsize__ + 64:
        raise SystemExit("gen_iframe %d implausible" % out["gen_iframe"])

    class Awaitable:
        def __init__(self, it):
            self.it = it

        def __await__(self):
            return self.it

    def gen():
        yield

    @types.coroutine
    def bare_yield():
        yield

    held = {}

    async def at_await(marker, it):
        a = b = c = 1           # locals move the stack top by a known amount
        await Awaitable(it)
        return a + b + c

    async def at_await_more(marker, it):
        a = b = c = d = e = f = g = h = 1
        await Awaitable(it)
        return a + b + c + d + e + f + g + h

    async def at_yield():
        await bare_yield()

    async def executing():
        me = held["me"]
        return bytes(ctypes.string_at(id(me), out["gen_iframe"]))

    gsize = out["gen_iframe"]

    def snap(c):
        return bytes(ctypes.string_at(id(c), gsize))

    marker = object()
    created = at_await(marker, gen())
    s_created = snap(created)
    it1 = gen()
    c1 = at_await(marker, it1)
    c1.send(None)
    s_await = snap(c1)
    c_y = at_yield()
    c_y.send(None)
    s_yield = snap(c_y)
    c_x = executing()
    held["me"] = c_x
    try:
        c_x.send(None)
    except StopIteration as e:
        s_exec = e.value
    s_done = snap(c_x)
    cands = [o for o in range(16, gsize)
             if len({s_created[o], s_await[o], s_exec[o], s_done[o]}) == 4]
    off = one("gi_frame_state", cands)
    out["gen_frame_state"] = off

    def sb(b):
        return b - 256 if b > 127 else b
    out["frame_state"] = {"created": sb(s_created[off]), "suspended_await": sb(s_await[off]),
                          "suspended_yield": sb(s_yield[off]), "executing": sb(s_exec[off]),
                          "completed_or_cleared": sb(s_done[off])}

    # Where the awaited iterator sits: scan each frame for it, then find the
    # field that says where the stack top is (3.11-3.13: an int index into
    # localsplus; 3.14+: a pointer one past the top), using two frames with
    # different numbers of locals.
    it2 = gen()
    c2 = at_await_more(marker, it2)
    c2.send(None)
    fr1 = id(c1) + out["gen_iframe"]
    fr2 = id(c2) + out["gen_iframe"]
    # localsplus[0] is the first argument; the stack starts after the
    # locals; copies of `it` above the stack top (left by the call that
    # built the Awaitable) are ignored by asking the stack-top field.
    ls = one("localsplus", [o for o in find(fr1, 256, id(marker)) if o in find(fr2, 256, id(marker))])
    out["iframe_localsplus"] = ls
    hits1, hits2 = find(fr1, 512, id(it1)), find(fr2, 512, id(it2))
    ptr = [(o, k) for k in (1, 2) for o in range(0, ls, W)
           if word(fr1 + o) - k * W - fr1 in hits1 and word(fr2 + o) - k * W - fr2 in hits2
           and word(fr1 + o) - k * W - fr1 > ls + W]
    if ptr:
        # 3.15 keeps a NULL slot above the awaited iterator while it is suspended
        out["iframe_stackpointer"], out["stack_above_awaited"] = one("stackpointer", ptr)
        out["iframe_stacktop"] = -1
    else:
        ints = [o for o in range(0, ls, 4)
                if 1 < i32(fr1 + o) < 64 and 1 < i32(fr2 + o) < 64
                and ls + W * (i32(fr1 + o) - 1) in hits1 and ls + W * (i32(fr2 + o) - 1) in hits2
                and i32(fr2 + o) - i32(fr1 + o) == 5]
        out["iframe_stacktop"] = one("stacktop", ints)
        out["iframe_stackpointer"] = -1
        out["stack_above_awaited"] = 1

    # FutureIter: the future it iterates
    fi = fut.__await__()
    out["futureiter_future"] = one("futureiter_future",
                                   find(id(fi), type(fi).__basicsize__, id(fut)))

    # -- where every task is found ------------------------------------------------
    # 3.11-3.13: asyncio.tasks._scheduled_tasks, a WeakSet, reached from
    # interp->modules (sys.modules) -> "asyncio.tasks" -> its dict.
    api = ctypes.pythonapi
    api.PyInterpreterState_Get.restype = ctypes.c_void_p
    interp = api.PyInterpreterState_Get()
    out["interp_modules"] = min(find(interp, 1 << 16, id(sys.modules)))
    import asyncio.tasks as at
    out["module_dict"] = one("module_dict", find(id(at), type(at).__basicsize__, id(at.__dict__)))
    glob = "_scheduled_tasks" if hasattr(at, "_scheduled_tasks") else "_all_tasks"
    ws = getattr(at, glob, None)
    out["tasks_global"] = glob
    if isinstance(ws, weakref.WeakSet) and sys.version_info < (3, 14):
        if task not in ws:
            raise SystemExit("task not in asyncio.tasks._scheduled_tasks")
        target = id(ws.data)
        base = id(ws)
        found = None
        for o in range(-64, type(ws).__basicsize__ + 64, W):
            if word(base + o) == target:
                found = {"kind": "direct", "offset": o}
                break
        if found is None:
            for o in (-32, -24):        # a managed dict's values / dict-or-values slot
                p = word(base + o)
                for tag in (0, 1):
                    # 3.12 tags a values pointer: it holds the address - 1
                    q = p + tag if (p & 1) == tag else 0
                    if q < 4096:
                        continue
                    try:
                        hits = [j for j in range(-16, 64, W) if word(q + j) == target]
                    except Exception:
                        hits = []
                    if hits:
                        found = {"kind": "deref", "offset": o, "tag": tag, "at": hits[0]}
                        break
                if found:
                    break
        if found is None:
            raise SystemExit("WeakSet.data not found")
        out["weakset_data"] = found
        r = next(iter(ws.data))
        out["weakref_object"] = one("weakref_object",
                                    find(id(r), type(r).__basicsize__, id(r())))
    # a set's used count, mask and table (the task WeakSet's, 3.14+'s awaited_by)
    big = set(range(100, 140))
    out["set_mask"], out["set_table"] = 32, 40
    table = word(id(big) + 40)
    if word(id(big) + 24) != len(big) or word(id(big) + 32) + 1 < len(big) or \
            not any(word(table + 16 * i) == id(120) for i in range(word(id(big) + 32) + 1)):
        raise SystemExit("set layout")
    out["dict_keys"] = 32
    out["dict_values"] = 40
    for c in (c1, c2, c_y, created):
        c.close()
    task.cancel()
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    print(json.dumps(out, sort_keys=True))


main()
