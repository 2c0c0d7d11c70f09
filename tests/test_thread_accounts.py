"""Each thread's exact times (collect/accounting.py) from thread records and
aggregated stacks made by hand, without BPF: the record of a thread is what
BPF keeps for it (bpf/pyoffcpu.h, struct thread_t), the stacks what a drain
adds.  Every expectation is exact: nanoseconds in, nanoseconds out."""
from types import SimpleNamespace

from pyoffcpu.collect.accounting import ThreadAccounts
from pyoffcpu.kernel.bpfdefs import KIND_ONCPU, KIND_OTHER, KIND_SLEEP, TH
from pyoffcpu.collect.recording import NO_STACK, UNSAMPLED, Options, PyStack, Recording
from pyoffcpu.cpython.code import CodeInfo

START, END = 1_000_000_000, 3_000_000_000          # a 2 s window (monotonic ns)
PID = 50


def record(tid, *, flags=0, on_ns=0, ts=0, first_ts=0, last_ts=0, exit_ts=0, unseen_ns=0, comm=b"worker",
           short_kind=(0, 0, 0, 0), short_n=(0, 0, 0, 0), short_ns=(0, 0, 0, 0), pend_kind=0, pend_kstack=-1, pend_ns=0):
    return SimpleNamespace(tgid=PID, comm=comm, on_ns=on_ns, flags=flags, ts=ts, first_ts=first_ts,
                           last_ts=last_ts, exit_ts=exit_ts, unseen_ns=unseen_ns, short_kind=short_kind, short_n=short_n,
                           short_ns=short_ns, pend_kind=pend_kind, pend_kstack=pend_kstack, pend_ns=pend_ns)


def accounts(mode="wall", fold=True, left_out=lambda ns: False):
    acc = ThreadAccounts(Recording(Options(mode=mode, fold_threads=fold)), left_out)
    acc.start_ns, acc.end_ns = START, END
    return acc


def on_key(tid, ustack, pyhash=0):
    return (PID, tid, ustack, -1, pyhash, KIND_ONCPU)


def close(acc, tid, th):
    acc.thread_times(tid, th)
    acc.close_thread(tid, th)
    acc.settle(tid)
    return acc.rec.threads.get(tid)


def test_sampled_stacks_are_scaled_to_the_exact_on_cpu_time_and_keep_their_counts():
    acc = accounts()
    # on the CPU 0.7 s (closed intervals) and since its last switch-in 0.2 s before the end
    th = record(11, flags=TH["ON"] | TH["FIRST_OUT"], on_ns=700_000_000, ts=END - 200_000_000,
                first_ts=START + 10)
    acc.add(on_key(11, 1), 3, 30_303_030)           # 3 samples
    acc.add(on_key(11, 2), 6, 60_606_060)           # 6 samples
    acc.add((PID, 11, 3, -1, 0, KIND_SLEEP), 4, 1_100_000_000)
    t = close(acc, 11, th)
    assert t.on_ns == 900_000_000 and t.first_ns == 0 and t.last_ns == END - START
    stacks = acc.rec.stacks
    assert stacks[on_key(11, 1)] == [3, 300_000_000] and stacks[on_key(11, 2)] == [6, 600_000_000]
    assert t.samples == 9
    assert stacks[(PID, 11, 3, -1, 0, KIND_SLEEP)] == [4, 1_100_000_000]     # off-CPU: as measured


def test_on_cpu_time_no_sample_landed_in_has_a_stack_of_its_own():
    acc = accounts()
    th = record(12, flags=TH["OFF"] | TH["FIRST_OUT"], on_ns=5_000_000, first_ts=START + 10)
    t = close(acc, 12, th)
    assert t.on_ns == 5_000_000 and acc.rec.stacks[(PID, 12, UNSAMPLED, -1, 0, KIND_ONCPU)] == [0, 5_000_000]


def test_a_thread_that_never_switches_is_on_the_cpu_the_whole_window():
    acc = accounts()
    acc.add(on_key(13, 1), 200, 2_020_202_020)
    t = close(acc, 13, record(13))                  # no first_ts: no switch at all
    assert t.on_ns == END - START and acc.rec.stacks[on_key(13, 1)] == [200, END - START]


def test_a_thread_blocked_the_whole_window_keeps_the_stacks_read_at_the_start():
    acc = accounts()
    acc.initial[14] = (PID, 77, KIND_SLEEP, 5)      # (pid, Python stack, kind, native stack)
    t = close(acc, 14, record(14))
    assert t.on_ns == 0
    assert acc.rec.stacks == {(PID, 14, 5, -1, 77, KIND_SLEEP): [1, END - START]}


def test_time_before_the_first_switch_in_and_after_a_missed_switch_out():
    acc = accounts()
    acc.initial[15] = (PID, 0, KIND_SLEEP, NO_STACK)   # asleep at the start, stack unreadable
    th = record(15, flags=TH["FIRST_IN"] | TH["OFF"], first_ts=START + 400_000_000,
                on_ns=100_000_000, unseen_ns=30_000_000)
    acc.add(on_key(15, 1), 1, 10_101_010)
    close(acc, 15, th)
    s = acc.rec.stacks
    assert s[(PID, 15, NO_STACK, -1, 0, KIND_SLEEP)] == [1, 400_000_000]    # blocked from the start
    assert s[(PID, 15, NO_STACK, -1, 0, KIND_OTHER)] == [1, 30_000_000]       # stack unknown
    assert s[on_key(15, 1)] == [1, 100_000_000]


def test_a_wait_left_out_by_length_is_counted_not_added():
    acc = accounts(left_out=lambda ns: ns > 1_000_000_000)
    close(acc, 16, record(16))
    assert acc.rec.stacks == {} and acc.filtered == [1, END - START]


def test_ended_threads_fold_by_their_entry_function_with_exact_sums():
    acc = accounts()
    code = CodeInfo("handle", "/srv/app.py", 1, b"", 0)
    acc.rec.pystacks[9] = PyStack(PID, 0, [(1, 0, 0)], [code])
    for i, tid in enumerate((21, 22)):
        th = record(tid, flags=TH["BORN"] | TH["EXITED"] | TH["FIRST_OUT"], on_ns=(i + 1) * 10_000_000,
                    first_ts=START + (i + 1) * 100, last_ts=START + (i + 1) * 1000)
        acc.add(on_key(tid, 1, pyhash=9), 1, 1)
        close(acc, tid, th)
    assert 21 not in acc.rec.threads and 22 not in acc.rec.threads
    (gid, g), = [(k, t) for k, t in acc.rec.threads.items() if k < 0]
    assert (g.threads, g.on_ns, g.samples, g.entry) == (2, 30_000_000, 2, "handle (app.py)")
    assert (g.first_ns, g.last_ns, g.first_tid) == (100, 2000, 21)
    assert acc.rec.stacks == {(PID, gid, 1, -1, 9, KIND_ONCPU): [2, 30_000_000]}


def test_keep_tids_keeps_every_ended_thread_and_cpu_mode_counts_samples():
    acc = accounts(mode="cpu", fold=False)
    th = record(31, flags=TH["BORN"] | TH["EXITED"], on_ns=123, first_ts=START + 1, last_ts=START + 2)
    acc.add(on_key(31, 1), 7, 7)
    t = close(acc, 31, th)
    assert t is acc.rec.threads[31] and t.exited and t.samples == 7
    assert t.on_ns == 7 * (10**9 // 99)             # samples x period at 99 Hz


def test_a_thread_whose_last_switch_out_was_missed_ends_at_its_exit_stamp():
    """Wall mode: a thread on a CPU since its last switch-in, whose exit BPF
    stamped (sched_process_exit) but whose last switch-out it did not see,
    runs until that stamp, not until the end of the recording; it is not
    folded mid-recording (only that switch-out says all its times are in),
    and is an ended thread at the end."""
    acc = accounts()
    exit_ts = START + 500_000_000
    th = record(41, flags=TH["BORN"] | TH["ON"] | TH["EXITING"], on_ns=1_000, ts=START + 400_000_000,
                first_ts=START + 100, exit_ts=exit_ts)
    assert not acc.ended_before(th, END)
    acc.thread_times(41, th)
    acc.close_thread(41, th)
    t = acc.rec.threads[41]
    assert t.exited and t.last_ns == 500_000_000 and t.first_ns == 100
    assert t.on_ns == 1_000 + 100_000_000
    # one that blocked on its way out after the stamp (switched out since) is still there
    th = record(44, flags=TH["BORN"] | TH["OFF"] | TH["EXITING"], on_ns=1_000, ts=exit_ts + 10,
                first_ts=START + 100, exit_ts=exit_ts)
    acc.thread_times(44, th)
    acc.close_thread(44, th)
    t = acc.rec.threads[44]
    assert not t.exited and t.last_ns == END - START and t.on_ns == 1_000


def test_cpu_mode_ends_a_thread_at_its_exit_stamp_once_its_samples_are_in():
    """cpu mode sees no switch: the exit stamp is the end, and the thread is
    closed by the first drain that flipped EXIT_SETTLE_NS after it."""
    from pyoffcpu.collect.accounting import EXIT_SETTLE_NS
    acc = accounts(mode="cpu", fold=False)
    exit_ts = START + 700_000_000
    th = record(42, flags=TH["BORN"] | TH["EXITING"], exit_ts=exit_ts)
    assert not acc.ended_before(th, exit_ts + EXIT_SETTLE_NS)
    assert acc.ended_before(th, exit_ts + EXIT_SETTLE_NS + 1)
    assert not acc.ended_before(record(43, flags=TH["BORN"]), END)
    acc.add(on_key(42, 1), 2, 2)
    t = close(acc, 42, th)
    assert t.exited and t.last_ns == 700_000_000 and t.samples == 2


def test_cpu_mode_folds_an_unsampled_ended_thread_as_the_whole_close_does():
    """fold_unsampled (the drains' shortcut for ended threads no sample
    landed in) gives the group what thread_times, close_thread, settle and
    fold give it; a thread with a sample, or one a drain saw alive, is not
    taken."""
    threads = [record(50 + i, flags=TH["BORN"] | TH["EXITING"], exit_ts=START + (i + 1) * 1_000_000,
                      comm=b"churn") for i in range(3)]
    full, short = accounts(mode="cpu"), accounts(mode="cpu")
    for th in threads:
        tid = threads.index(th) + 50
        close(full, tid, th)
        assert short.fold_unsampled(tid, th)
    assert short.rec.threads == full.rec.threads and len(full.rec.threads) == 1
    g = next(iter(full.rec.threads.values()))
    assert (g.threads, g.first_ns, g.last_ns, g.first_tid) == (3, 1_000_000, 3_000_000, 50)
    sampled = record(60, flags=TH["BORN"] | TH["EXITING"], exit_ts=START + 5)
    short.add(on_key(60, 1), 1, 1)
    assert not short.fold_unsampled(60, sampled)
    seen = record(61, flags=TH["BORN"] | TH["EXITING"], exit_ts=START + 5)
    short.thread_times(61, seen)
    assert not short.fold_unsampled(61, seen)
    assert not accounts().fold_unsampled(62, record(62, flags=TH["BORN"] | TH["EXITING"], exit_ts=START + 5))


def test_sampled_waits_left_in_a_threads_entry_are_added_at_its_close():
    """--off-cpu sampled: the short waits BPF keeps in the thread's entry
    until it flushes them, and a stack owed but not taken before the end,
    go to the thread with their exact time (their stack: none)."""
    from pyoffcpu.kernel import bpfdefs
    from pyoffcpu.collect.recording import SHORT_WAITS
    from pyoffcpu.profile.waits import KIND_SAMPLED, KIND_SHORT
    acc = accounts()
    futex = bpfdefs.KIND_SLEEP | (203 << bpfdefs.SYS_SHIFT)
    read = bpfdefs.KIND_SLEEP | (1 << bpfdefs.SYS_SHIFT)
    th = record(7, flags=TH["OFF"] | TH["PENDING"], ts=START + 10, first_ts=START + 5,
                short_kind=(0, futex, read, 0), short_n=(0, 12, 3, 0), short_ns=(0, 3456, 789, 0),
                pend_kind=futex | KIND_SAMPLED, pend_ns=10_101_010)
    acc.thread_times(7, th)
    acc.close_thread(7, th)
    stacks = acc.rec.stacks
    assert stacks[(PID, 7, SHORT_WAITS, -1, 0, futex | KIND_SHORT)] == [12, 3456]
    assert stacks[(PID, 7, SHORT_WAITS, -1, 0, read | KIND_SHORT)] == [3, 789]
    assert stacks[(PID, 7, NO_STACK, -1, 0, futex | KIND_SAMPLED)] == [1, 10_101_010]
    assert acc.rec.drops == {"wait's stack not taken (the recording ended)": 1}


def test_native_stacks_read_twice_for_one_thread_get_ids_of_their_own():
    """The waits open at the end are read in passes: a thread whose wait
    changed between two passes is read again.  Each read is a stack of its
    own (an id shared by two reads gave a thread the other's stack)."""
    from pyoffcpu.collect.preexisting import BlockedThreads
    caps = iter(range(100))
    session = SimpleNamespace(native_ids={}, rec=Recording(Options()),
                              unwinder=SimpleNamespace(capture_blocked=lambda pid, tid: ("cap", next(caps))))
    b = BlockedThreads(session)
    first = b.native_now(PID, 7, "end")
    again = b.native_now(PID, 7, "end")
    other = b.native_now(PID, 8, "end")
    assert len({first, again, other}) == 3
    assert b.captured[first] == (PID, ("cap", 0)) and b.captured[again] == (PID, ("cap", 1))
