"""profile/waits.py on hand-made keys (no BPF): how the sampled waits'
keys become one weight per stack, the totals exact to the nanosecond.

The BPF side is tests/test_offcpu_sampling.py's."""
from pyoffcpu.kernel import bpfdefs
from pyoffcpu.collect.recording import SHORT_WAITS
from pyoffcpu.profile import waits

T = 10_000_000
SAMPLED, SHORT, SHADOW = waits.KIND_SAMPLED, waits.KIND_SHORT, waits.KIND_SHADOW
FUTEX = bpfdefs.KIND_SLEEP | ((202 + 1) << bpfdefs.SYS_SHIFT)
READ = bpfdefs.KIND_SLEEP | ((0 + 1) << bpfdefs.SYS_SHIFT)
HELD = bpfdefs.GIL_HELD << bpfdefs.GIL_SHIFT


def key(tid, ustack, pystack, kind):
    return (1, tid, ustack, -1, pystack, kind)


def per_thread_off(stacks):
    out = {}
    for k, (_c, ns) in stacks.items():
        if not bpfdefs.on_cpu(k[5]):
            out[k[1]] = out.get(k[1], 0) + ns
    return out


def test_short_total_is_split_over_the_sampled_stacks_in_proportion():
    stacks = {
        key(10, SHORT_WAITS, 0, FUTEX | SHORT): [1000, 1_000_000_001],    # exact total of 1,000 short waits
        key(10, 5, 0xA, FUTEX | SAMPLED): [3, 3 * T],
        key(10, 6, 0xB, FUTEX | SAMPLED | HELD): [1, T],                 # GIL bits kept
        key(10, 7, 0xC, FUTEX): [1, 50_000_000],                         # a long wait: exact
        key(10, 5, 0xA, FUTEX): [2, 40_000_000],                         # long ones of A's stack
        key(10, 8, 0, bpfdefs.KIND_ONCPU): [7, 70_000_000],
    }
    out, _w, counts = waits.resolve(stacks, {}, "sampled", T)
    assert out[key(10, 5, 0xA, FUTEX)] == [5, 40_000_000 + 750_000_000]     # merged with its exact key
    assert out[key(10, 6, 0xB, FUTEX | HELD)] == [1, 250_000_001]           # the remainder
    assert out[key(10, 7, 0xC, FUTEX)] == [1, 50_000_000]
    assert out[key(10, 8, 0, bpfdefs.KIND_ONCPU)] == [7, 70_000_000]
    assert not any(k[5] & waits.KIND_FLAGS for k in out)
    # every nanosecond of the thread's off-CPU time is there, none twice
    assert per_thread_off(out) == {10: 1_000_000_001 + 50_000_000 + 40_000_000}
    assert (counts.offcpu, counts.exact, counts.short, counts.sampled) == ("sampled", 3, 1000, 4)


def test_buckets_are_per_thread_and_kind():
    stacks = {
        key(10, SHORT_WAITS, 0, FUTEX | SHORT): [10, 100],
        key(10, SHORT_WAITS, 0, READ | SHORT): [10, 900],
        key(11, SHORT_WAITS, 0, FUTEX | SHORT): [10, 5000],
        key(10, 5, 0xA, FUTEX | SAMPLED): [1, T],
        key(10, 6, 0xB, READ | SAMPLED): [1, T],
        key(11, 6, 0xB, FUTEX | SAMPLED): [1, T],
    }
    out, _w, _c = waits.resolve(stacks, {}, "sampled", T)
    assert out == {key(10, 5, 0xA, FUTEX): [1, 100], key(10, 6, 0xB, READ): [1, 900],
                   key(11, 6, 0xB, FUTEX): [1, 5000]}


def test_a_kind_with_no_stack_sampled_keeps_its_total_without_a_stack():
    stacks = {key(10, SHORT_WAITS, 0, FUTEX | SHORT): [40, 123_456]}
    out, _w, counts = waits.resolve(stacks, {}, "sampled", T)
    assert out == {key(10, SHORT_WAITS, 0, FUTEX): [40, 123_456]}
    assert (counts.short, counts.sampled) == (40, 0)


def test_wakers_of_sampled_waits_get_the_same_share():
    a = key(10, 5, 0xA, FUTEX | SAMPLED)
    b = key(10, 6, 0xB, FUTEX | SAMPLED)
    stacks = {key(10, SHORT_WAITS, 0, FUTEX | SHORT): [100, 600], a: [2, 2 * T], b: [1, T]}
    waker = (1, 1, 12, -1, -1, 0, "main")
    wakes = {(a, waker): [2, 2 * T], (b, waker): [1, T // 2]}
    out, out_wakes, _c = waits.resolve(stacks, wakes, "sampled", T)
    assert out[key(10, 5, 0xA, FUTEX)] == [2, 400]
    assert out_wakes == {(key(10, 5, 0xA, FUTEX), waker): [2, 400],
                         (key(10, 6, 0xB, FUTEX), waker): [1, 100]}


def test_a_shadow_recording_gives_either_view():
    exact_a = key(10, 5, 0xA, FUTEX)
    stacks = {
        exact_a: [100, 1000],                                   # the switch-out captures
        key(10, 8, 0, bpfdefs.KIND_ONCPU): [3, 30],             # on-CPU: in both
        key(10, SHORT_WAITS, 0, FUTEX | SHORT | SHADOW): [100, 1000],
        key(10, 5, 0xA, FUTEX | SAMPLED | SHADOW): [1, T],
    }
    ex, _w, cx = waits.resolve(stacks, {}, "shadow", T, view="exact")
    sa, _w, cs = waits.resolve(stacks, {}, "shadow", T, view="sampled")
    assert ex == {exact_a: [100, 1000], key(10, 8, 0, bpfdefs.KIND_ONCPU): [3, 30]}
    assert sa == {exact_a: [1, 1000], key(10, 8, 0, bpfdefs.KIND_ONCPU): [3, 30]}
    assert cx.offcpu == "exact" and cs.offcpu == "sampled"
    assert per_thread_off(ex) == per_thread_off(sa)


def test_exact_recordings_pass_as_they_are():
    stacks = {key(10, 5, 0xA, FUTEX | HELD): [4, 4000], key(10, 8, 0, bpfdefs.KIND_ONCPU): [3, 30]}
    out, _w, counts = waits.resolve(stacks, {}, "exact", T)
    assert out == stacks and out is not stacks
    assert (counts.offcpu, counts.exact, counts.short) == ("exact", 4, 0)
