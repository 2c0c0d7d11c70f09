/* pyoffcpu's BPF side, compiled by bcc at load time.
 *
 * on_cpu_sample (perf_event cpu-clock) and sched_switch (raw tracepoint)
 * both capture one stack_key per event: kernel and user stack ids, and the
 * hash of the Python stack walked here.  Times are aggregated in `agg`; the
 * loader drains it, one generation at a time (control.gen).  New Python
 * stacks go to user space once, through pystack_events, so their code objects
 * are resolved while the target is alive.  sched_switch also keeps each
 * target thread's exact on-CPU time (threads), and sched_process_fork
 * registers the threads a target starts.
 *
 * Set by the loader with -D:
 *   TASK_FSBASE_OFF       offsetof(task_struct, thread.fsbase), from BTF
 *   TASK_PID_OFF, TASK_TGID_OFF   offsetof(task_struct, pid / tgid), from BTF
 *   TASK_EXEC_OFF         offsetof(task_struct, se.sum_exec_runtime), from BTF
 *   SAMPLE_PERIOD_NS      on-CPU sampling period
 *   KERNEL_STACKS         1 to capture kernel stacks
 *   SYSTEM_WIDE           1 to take every process, not only those in `procs`
 *   EXIT_GROUP_DEAD       1 if sched_process_exit passes group_dead (BTF)
 *   SYS_REGS_IP_OFF, SYS_REGS_CS_OFF, SYS_REGS_ORIG_AX_OFF   pt_regs offsets (BTF), for
 *                         the system call a thread blocks in (none: not told)
 *   NATIVE_UNWIND         1 to walk user stacks with .eh_frame tables (bpf/unwind.h;
 *                         0: frame pointers, through the same finishing programs)
 *   TASK_RSEQ_OFF         offsetof(task_struct, rseq), from BTF (-1: not known)
 * Kernel structs are never dereferenced by type: the headers bcc compiles
 * against are not the running kernel's.
 */
#include <uapi/linux/ptrace.h>
/* What <uapi/linux/bpf_perf_event.h> provides (x86_64, where its
 * bpf_user_pt_regs_t is struct pt_regs), defined here: including it costs
 * ~0.6 s of clang and ~40 MiB at every compile.  The programs only hand ctx
 * to helpers. */
struct bpf_perf_event_data {
    struct pt_regs regs;
    __u64 sample_period;
    __u64 addr;
};
#include "pyoffcpu.h"

#define PY_MASK (MAX_PY_DEPTH - 1)
#ifndef TASK_RSEQ_OFF
#define TASK_RSEQ_OFF -1
#endif
#define TASK_DEAD_STATE 0x80        /* TASK_DEAD in prev_state: the thread's last switch */

BPF_ARRAY(control, struct control_t, 1);
BPF_HASH(procs, u32, struct proc_info, 4096);
BPF_HASH(agg, struct stack_key, struct stack_value, 65536);
BPF_HASH(offcpu_start, u32, struct offcpu_start, 65536);
BPF_HASH(pystack_seen, u64, u8, 131072);
BPF_HASH(threads, u32, struct thread_t, 65536);
BPF_HASH(pystack_fix, u32, struct pystack_fix, 4096);
/* Per target process: how many times it called exec (its layouts are gone). */
BPF_HASH(execs, u32, u64, 4096);
/* The life log (pyoffcpu.h) and its count of entries written. */
BPF_F_TABLE("array", u32, struct life_event, life_log, LIFE_LOG, BPF_F_MMAPABLE);
BPF_F_TABLE("array", u32, u64, life_total, 1, BPF_F_MMAPABLE);   /* read by mmap: no syscall a look */
/* --subprocesses: child tgid -> parent tgid | the parent's exec count at
 * the fork << 32, for each process a target started (registered here at its
 * fork; user space takes it from there: the same exec count now means the
 * child is a copy of the parent's current image). */
BPF_HASH(forks, u32, u64, 4096);
/* SYSTEM_WIDE: samples of each process that had no procs entry yet (user
 * space registers every process it finds here; the count is what it missed). */
BPF_HASH(unregistered, u32, u64, 4096);
BPF_STACK_TRACE(ustacks, 32768);
BPF_STACK_TRACE(kstacks, 16384);
BPF_PERCPU_ARRAY(scratch, struct pystack, 3);   /* 0: on-CPU program, 1: sched_switch, 2: sched_waking */
BPF_PERCPU_ARRAY(drops, u64, N_DROPS);
BPF_PERCPU_ARRAY(drops_ns, u64, N_DROPS);
BPF_PERF_OUTPUT(pystack_events);
#ifndef WAKERS
#define WAKERS 0
#endif
#if WAKERS
BPF_HASH(last_waker, u32, struct waker_t, 65536);       /* wakee tid -> its last waker */
BPF_HASH(wake_agg, struct wake_key, struct stack_value, 65536);
/* Per CPU: how deep in interrupt handlers (0), and in timer expiries (1). */
BPF_PERCPU_ARRAY(irq_depth, u32, 2);
#endif
/* Waits left out by --min-block-us / --max-block-us: 0 how many, 1 their ns. */
BPF_PERCPU_ARRAY(block_filtered, u64, 2);
/* The kernel's fold of ended threads (pyoffcpu.h, fold_exit). */
/* preallocated (an insert at every thread's birth; 5 MiB): more live
 * threads born in the recording than entries are left to user space */
BPF_HASH(held_keys, u32, struct held_t, 4096);
BPF_ARRAY(held_zero, struct held_t, 1);    /* never written: a fresh held_t */
BPF_HASH(group_ids, struct group_id_key, u32, 4096);
BPF_HASH(groups, struct group_key, struct group_t, 16384);
BPF_PROG_ARRAY(fold_progs, 1);
BPF_PERCPU_ARRAY(group_count, u64, 1);     /* group ids made on this CPU */
/* Python stack hash -> STACK_ENTRY / STACK_NO_ENTRY: whether user space
 * finds an entry function in it (ThreadAccounts.stack_entry), written as
 * the stacks arrive.  A thread with a stack not in it is left to user space. */
BPF_HASH(stack_class, u64, u8, 65536);

static __always_inline void count_drop(int idx)
{
    u64 *v = drops.lookup(&idx);
    if (v)
        (*v)++;
}

static __always_inline void count_drop_ns(int idx, u64 ns)
{
    count_drop(idx);
    u64 *v = drops_ns.lookup(&idx);
    if (v)
        *v += ns;
}

/* The session's control block while recording: NULL before the start, from
 * the end on, and for an event stamped outside the window. */
static __always_inline int recording_at(struct control_t *ctl, u64 now)
{
    if (!ctl->start_ns || now < ctl->start_ns)
        return 0;
    return !ctl->end_ns || now < ctl->end_ns;
}

static __always_inline struct control_t *recording(u64 now)
{
    int zero = 0;
    struct control_t *ctl = control.lookup(&zero);
    if (!ctl || !recording_at(ctl, now))
        return 0;
    return ctl;
}

/* current_tstate and walk_python, shared with crashes.bpf.c; inlined by the
 * loader, as unwind.h below. */
#include "pywalk.h" /* inline */

/* Does the thread of tstate hold its interpreter's GIL (GIL_*)?  It does
 * when the GIL is locked and its last_holder is this thread state: take_gil
 * sets both under the GIL's mutex, drop_gil clears `locked` first. */
static __always_inline u32 gil_state(struct proc_info *pi, u64 tstate)
{
    if (!tstate || pi->gil_holder < 0)
        return GIL_UNKNOWN;
    int failed = 0;
    u64 gil = pi->gil_addr;
    if (pi->interp_ceval_gil >= 0) {
        u64 interp = read_u64(tstate + pi->tstate_interp, &failed);
        gil = failed ? 0 : read_u64(interp + pi->interp_ceval_gil, &failed);
    }
    if (failed || !gil)
        return GIL_UNKNOWN;
    u64 g[2] = {};                  /* last_holder, then locked (an int) */
    if (bpf_probe_read_user(g, sizeof(g), (void *)(gil + pi->gil_holder)) != 0)
        return GIL_UNKNOWN;
    if (!((u32)g[1] && g[0] == tstate))
        return GIL_FREE;
    /* the collector runs under the GIL: its holder is the one collecting */
    u64 flag = pi->gc_flag;
    if (!flag && pi->gc_collecting >= 0) {
        u64 interp = read_u64(tstate + pi->tstate_interp, &failed);
        flag = failed ? 0 : interp + pi->gc_collecting;
    }
    int collecting = 0;
    if (flag && bpf_probe_read_user(&collecting, sizeof(collecting), (void *)flag) == 0 && collecting)
        return GIL_HELD_GC;
    return GIL_HELD;
}

/* The current thread's user registers, as saved at kernel entry (right for
 * a sample taken in kernel mode and at sched_switch alike); 0 when it has
 * none.  pt_regs offsets from BTF (-DPT_REGS_*_OFF, with NATIVE_UNWIND). */
static __always_inline int current_user_regs(u64 *pc, u64 *sp, u64 *bp, u64 *bx)
{
#if NATIVE_UNWIND
    struct task_struct *task = bpf_get_current_task_btf();
    u64 regs = bpf_task_pt_regs(task);
    if (!regs)
        return 0;
    u64 cs = 0;
    long err = bpf_probe_read_kernel(pc, 8, (void *)(regs + PT_REGS_IP_OFF));
    err |= bpf_probe_read_kernel(sp, 8, (void *)(regs + PT_REGS_SP_OFF));
    err |= bpf_probe_read_kernel(bp, 8, (void *)(regs + PT_REGS_BP_OFF));
    err |= bpf_probe_read_kernel(bx, 8, (void *)(regs + PT_REGS_BX_OFF));
    err |= bpf_probe_read_kernel(&cs, 8, (void *)(regs + PT_REGS_CS_OFF));
    return err == 0 && (cs & 3) == 3;
#else
    return 0;
#endif
}

/* Inlined by the loader (session._bpf_source): bcc rewrites map calls such
 * as table.lookup() only in the main file. */
#include "unwind.h" /* inline */

/* Fill key for the current thread; sends a Python stack seen for the first
 * time.  kernel: take the kernel stack (KERNEL_STACKS) too; 0 leaves key->kstack. */
static __always_inline void capture(void *ctx, struct stack_key *key, u32 tgid, u32 tid, int slot,
                                    int kernel)
{
    key->tgid = tgid;
    key->tid = tid;
    key->ustack = -1;
    /* Walked from .eh_frame tables by the finishing program (bpf/unwind.h),
     * once the Python walk is done; frame pointers otherwise. */
    if (!unwind_prepare(tgid, slot)) {
        key->ustack = ustacks.get_stackid(ctx, BPF_F_USER_STACK);
        if (key->ustack < 0)
            count_drop(DROP_USTACK);
    }
    key->nstack = 0;
    if (kernel) {
#if KERNEL_STACKS
        key->kstack = kstacks.get_stackid(ctx, 0);
        if (key->kstack < 0 && key->kstack != -14)  /* -EFAULT: sampled in user mode */
            count_drop(DROP_KSTACK);
#else
        key->kstack = -1;
#endif
    }
    key->pystack = 0;
    struct proc_info *pi = procs.lookup(&tgid);
    if (!pi) {
#if SYSTEM_WIDE
        unregistered.atomic_increment(tgid);
#endif
        return;
    }
    struct pystack *st = scratch.lookup(&slot);
    if (!st)
        return;
    u64 tstate = pi->walker != WALK_NONE ? current_tstate(pi) : 0;
    key->kind |= gil_state(pi, tstate) << GIL_SHIFT;
    u64 h = walk_python(pi, st, tgid, tstate);
    key->pystack = h;
    if (!h)
        return;
    if (pystack_seen.lookup(&h))
        return;
    u8 one = 1;
    if (pystack_seen.insert(&h, &one) != 0)
        count_drop(DROP_PYSTACK_FULL);
    pystack_events.perf_submit(ctx, st, sizeof(*st));
}

static __always_inline int is_target(struct control_t *ctl, u32 tgid)
{
#if SYSTEM_WIDE
    return tgid != ctl->self_tgid;
#else
    u32 n = ctl->ntargets;
    if (n > MAX_INLINE_TARGETS)
        return procs.lookup(&tgid) != 0;
    /* the common case: a few targets, compared inline (no hash lookup for the
     * switches of every other thread on the machine) */
#pragma unroll
    for (int i = 0; i < MAX_INLINE_TARGETS; i++) {
        if (i < n && ctl->targets[i] == tgid)
            return 1;
    }
    return 0;
#endif
}

/* Add count events of ns to the key's entry.  A thread whose keys are held
 * for the kernel's fold (held_keys) keeps them in GEN_HELD, listed in the
 * order they are made; the one that would not fit ends the holding (the
 * thread goes to user space, the keys made from then on to the drains). */
static __always_inline void add_time_n(struct stack_key *key, u64 count, u64 ns)
{
    int zero = 0;
    struct control_t *ctl = control.lookup(&zero);
    if (!ctl)
        return;
    key->gen = ctl->gen;
    struct held_t *h = 0;
    if (ctl->fold) {
        u32 tid = key->tid;
        h = held_keys.lookup(&tid);
        if (h && !h->overflow)
            key->gen = GEN_HELD;
    }
    struct stack_value *v = agg.lookup(key);
    if (!v) {
        if (h && key->gen == GEN_HELD && h->n >= MAX_HELD) {
            h->overflow = 1;
            key->gen = ctl->gen;
            v = agg.lookup(key);
        }
    }
    if (!v) {
        struct stack_value init = {};
        int made = agg.insert(key, &init) == 0;
        v = agg.lookup(key);
        if (!v) {
            count_drop_ns(DROP_AGG_FULL, ns);
            return;
        }
        if (made && h && key->gen == GEN_HELD) {
            u32 n = h->n;
            if (n < MAX_HELD) {
                __builtin_memcpy(&h->keys[n & (MAX_HELD - 1)], key, sizeof(*key));
                h->n = n + 1;
            }
        }
    }
    __sync_fetch_and_add(&v->count, count);
    __sync_fetch_and_add(&v->ns, ns);
}

static __always_inline void add_time(struct stack_key *key, u64 ns)
{
    add_time_n(key, 1, ns);
}

/* The thread's entry, made when a target thread is met without one (it was
 * missed at the start, or the threads map was full then). */
static __always_inline struct thread_t *thread_entry(u32 tid, u32 tgid)
{
    struct thread_t *th = threads.lookup(&tid);
    if (th)
        return th;
    struct thread_t fresh = {};
    fresh.tgid = tgid;
    bpf_get_current_comm(&fresh.comm, sizeof(fresh.comm));
    if (threads.insert(&tid, &fresh) != 0) {
        count_drop(DROP_THREADS_FULL);
        return 0;
    }
    return threads.lookup(&tid);
}

int on_cpu_sample(struct bpf_perf_event_data *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    if (tid == 0)
        return 0;
    struct control_t *ctl = recording(bpf_ktime_get_ns());
    if (!ctl || !is_target(ctl, tgid))
        return 0;
    struct thread_t *th = thread_entry(tid, tgid);
    if (th)                         /* its name, as it is now */
        bpf_get_current_comm(&th->comm, sizeof(th->comm));
    /* The key lives in the per-CPU unwind state: the finishing program
     * (unwind_perf, bpf/unwind.h) walks the native stack and adds the
     * sample.  Nothing but the tail call follows the Python walk: every
     * instruction there is verified once per state the walk ends in. */
    int slot = 0;
    struct unwind_state *us = unwind_scratch.lookup(&slot);
    if (!us)
        return 0;
    struct stack_key *key = &us->key;
    __builtin_memset(key, 0, sizeof(*key));
    key->kind = KIND_ONCPU;
    us->ts = 0;
    capture(ctx, key, tgid, tid, 0, 1);
    unwind_perf_progs.call(ctx, 0);
    add_time(key, SAMPLE_PERIOD_NS);    /* the tail call failed */
    return 0;
}

/* The system call the current thread is blocked in, for the high bits of
 * an off-CPU key's kind: its number + 1; SYS_OUTSIDE when the thread is in
 * none (it entered the kernel by a fault or an interrupt); 0 when that
 * cannot be told (no user registers: a kernel thread).  x86_64's system
 * call entry saves the call's number in orig_ax and -ENOSYS in ax, which
 * stays there until the call returns; a fault leaves the user's rax in ax
 * and its error code in orig_ax, an interrupt ~vector (< 0).  One read of
 * pt_regs from ax to cs (offsets from BTF: -DSYS_REGS_*_OFF), no user
 * memory: the instruction before the user pc, read here before, was a
 * third of a switch-out's cost. */
#define NEG_ENOSYS (-38)
static __always_inline u32 current_syscall(void)
{
#if defined(SYS_REGS_ORIG_AX_OFF) && defined(SYS_REGS_AX_OFF) && defined(SYS_REGS_CS_OFF)
#define SYS_REGS_WORDS ((SYS_REGS_CS_OFF - SYS_REGS_AX_OFF) / 8 + 1)
    _Static_assert(SYS_REGS_AX_OFF < SYS_REGS_ORIG_AX_OFF && SYS_REGS_ORIG_AX_OFF < SYS_REGS_CS_OFF &&
                   SYS_REGS_WORDS <= 16, "pt_regs: ax, orig_ax and cs within 128 bytes, in that order");
    struct task_struct *task = bpf_get_current_task_btf();
    u64 regs = bpf_task_pt_regs(task);
    if (!regs)
        return 0;
    u64 r[SYS_REGS_WORDS];
    if (bpf_probe_read_kernel(r, sizeof(r), (void *)(regs + SYS_REGS_AX_OFF)) != 0)
        return 0;
    s64 ax = (s64)r[0];
    s64 nr = (s64)r[(SYS_REGS_ORIG_AX_OFF - SYS_REGS_AX_OFF) / 8];
    u64 cs = r[(SYS_REGS_CS_OFF - SYS_REGS_AX_OFF) / 8];
    if ((cs & 3) != 3)
        return 0;
    if (ax != NEG_ENOSYS || nr < 0 || nr >= SYS_OUTSIDE - 1)
        return SYS_OUTSIDE;
    return (u32)nr + 1;
#else
    return 0;
#endif
}

static __always_inline u32 off_cpu_kind(u64 preempt, u64 state)
{
    if (preempt || state == 0)      /* preempted, or yielded: still runnable */
        return KIND_RUNQUEUE;
    if (state & 1)                  /* TASK_INTERRUPTIBLE */
        return KIND_SLEEP;
    if (state & 2)                  /* TASK_UNINTERRUPTIBLE; TASK_IDLE adds TASK_NOLOAD */
        return (state & 0x400) ? KIND_SLEEP : KIND_UNINTERRUPTIBLE;
    return KIND_OTHER;
}

/* The key of a thread's open off-CPU interval, with the Python stack user
 * space found for it if BPF had none (pystack_fix). */
static __always_inline void open_key(u32 tid, struct offcpu_start *st, struct stack_key *key)
{
    __builtin_memcpy(key, &st->key, sizeof(*key));
    if (key->pystack)
        return;
    struct pystack_fix *fx = pystack_fix.lookup(&tid);
    if (fx) {
        if (fx->ts == st->ts)
            key->pystack = fx->pystack;
        pystack_fix.delete(&tid);
    }
}

#if WAKERS
/* A wait of tid that began at `from` ends: its waker, if it woke the thread
 * after the wait began (an older one woke an earlier wait). */
static __always_inline void add_wake(u32 tid, u64 from, struct stack_key *key, u64 ns)
{
    struct wake_key wk = {};
    wk.tgid = key->tgid;
    wk.tid = tid;
    wk.ustack = key->ustack;
    wk.kstack = key->kstack;
    wk.pystack = key->pystack;
    wk.kind = key->kind;
    wk.gen = key->gen;              /* add_time set it */
    wk.nstack = key->nstack;
    struct waker_t *w = last_waker.lookup(&tid);
    if (w && w->ts >= from) {
        wk.waker_kind = w->kind;
        wk.waker_tgid = w->tgid;
        wk.waker_tid = w->tid;
        wk.waker_ustack = w->ustack;
        wk.waker_kstack = w->kstack;
        wk.waker_pystack = w->pystack;
        wk.waker_nstack = w->nstack;
        wk.waker_comm0 = w->comm[0];
        wk.waker_comm1 = w->comm[1];
    } else {
        wk.waker_ustack = wk.waker_kstack = -1;
    }
    struct stack_value init = {};
    struct stack_value *v = wake_agg.lookup_or_try_init(&wk, &init);
    if (!v)
        return;
    __sync_fetch_and_add(&v->count, 1);
    __sync_fetch_and_add(&v->ns, ns);
}
#endif

#include "waits.h" /* inline */

/* Which of a switch's two threads belong to a target: SW_PREV (the thread
 * going off the CPU, still current) and SW_NEXT.  Every switch on the machine
 * pays for this, whoever it is of, so the common case (a few targets, inline
 * in control) takes no map lookup and no helper call.  The same answer as
 * `prev_tid && is_target(prev_tgid)`, `next_tgid && is_target(next_tgid)`;
 * the inline list holds target pids, never 0, so the idle task (and a next
 * whose tgid could not be read, 0) never matches it. */
#define SW_PREV 1
#define SW_NEXT 2
static __always_inline u32 switch_targets(struct control_t *ctl, u32 prev_tid, u32 prev_tgid,
                                          u32 next_tgid)
{
#if SYSTEM_WIDE
    return (prev_tid && prev_tgid != ctl->self_tgid ? SW_PREV : 0) |
           (next_tgid && next_tgid != ctl->self_tgid ? SW_NEXT : 0);
#else
    u32 n = ctl->ntargets;
    u32 which = 0;
    if (__builtin_expect(n > MAX_INLINE_TARGETS, 0)) {
        u32 key = prev_tgid;
        if (prev_tid && procs.lookup(&key))
            which |= SW_PREV;
        key = next_tgid;
        if (next_tgid && procs.lookup(&key))
            which |= SW_NEXT;
        return which;
    }
#pragma unroll
    for (int i = 0; i < MAX_INLINE_TARGETS; i++) {
        if (i < n) {
            u32 t = ctl->targets[i];
            if (t == prev_tgid)
                which |= SW_PREV;
            if (t == next_tgid)
                which |= SW_NEXT;
        }
    }
    return which;
#endif
}

/* Raw tracepoint: args are (bool preempt, struct task_struct *prev,
 * struct task_struct *next, unsigned int prev_state).  prev is current.
 *
 * Bystanders first: a switch between two threads of no target returns after
 * the control lookup (an array: inlined by the verifier), one read of next's
 * tgid and the compares of switch_targets, which read only control's target list:
 * no clock read, no hash lookup.  Only a switch of a target reads the clock
 * and then checks the recording window on that `now`; the tests before it do
 * not depend on time, so the same switches are recorded, with the same
 * numbers, as when the window was checked first. */
RAW_TRACEPOINT_PROBE(sched_switch)
{
    int zero = 0;
    struct control_t *ctl = control.lookup(&zero);
    if (!ctl)
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    /* next's tgid from its task_struct (offsets from BTF), with its pid in
     * the same read where they are side by side, as in every kernel */
    u32 next_tgid = 0, next_tid = 0;
#if TASK_TGID_OFF == TASK_PID_OFF + 4
    u32 pt[2] = {};
    bpf_probe_read_kernel(pt, sizeof(pt), (void *)(ctx->args[2] + TASK_PID_OFF));
    next_tid = pt[0];
    next_tgid = pt[1];
#else
    bpf_probe_read_kernel(&next_tgid, sizeof(next_tgid), (void *)(ctx->args[2] + TASK_TGID_OFF));
#endif
    u32 which = switch_targets(ctl, (u32)id, id >> 32, next_tgid);
    if (__builtin_expect(which == 0, 1))
        return 0;

    u64 now = bpf_ktime_get_ns();
    if (!recording_at(ctl, now))
        return 0;
    u32 tgid = id >> 32, prev = (u32)id;
    u64 next = ctx->args[2];

    /* Switch-in. */
    if (which & SW_NEXT) {
#if TASK_TGID_OFF != TASK_PID_OFF + 4
        bpf_probe_read_kernel(&next_tid, sizeof(next_tid), (void *)(next + TASK_PID_OFF));
#endif
        if (next_tid)
            switch_in(ctl, next_tid, now, next);
    }

    /* Switch-out: prev is current (bpf_get_current_pid_tgid is its), so
     * its stacks are ours to take. */
    if (!(which & SW_PREV))
        return 0;
    struct thread_t *th = thread_entry(prev, tgid);
    if (!th)
        return 0;
    if (!th->first_ts) {
        th->first_ts = now;
        th->flags |= TH_FIRST_OUT;
    }
    /* on the CPU since its switch-in, or since the start when this is its
     * first switch (it was running then) */
    /* The kernel's own count of the thread's time on a CPU, up to date here
     * (put_prev_task ran update_curr before this tracepoint). */
    u64 exec = 0;
    bpf_probe_read_kernel(&exec, sizeof(exec), (void *)(ctx->args[1] + TASK_EXEC_OFF));
    u64 from;
    if (th->flags & TH_ON) {
        from = th->ts;
    } else if (th->flags & TH_OFF) {
        /* Off since its last switch-out, yet running: its switch-in was not
         * seen (it happens, rarely, under load).  The runtime it gained since
         * then is its time on a CPU; the rest of the span was off-CPU and
         * closes the interval its last switch-out opened. */
        u64 span = now - th->ts;
        u64 on = exec > th->exec_ns ? exec - th->exec_ns : 0;
        if (on > span)
            on = span;
        /* --min/--max-block-us judge that part as the wait's length */
        u64 off = span > on ? span - on : 0;
        int kept = off && !left_out(ctl, off, off);
        struct offcpu_start *open_st = (th->flags & TH_CAPTURED) ? offcpu_start.lookup(&prev) : 0;
        if (open_st) {
            struct stack_key okey;
            open_key(prev, open_st, &okey);
            offcpu_start.delete(&prev);
            if (kept) {
                add_time(&okey, span - on);
                th->off_ns += span - on;
                if (ctl->offcpu == OFFCPU_SHADOW) {     /* the sampled view's too */
                    okey.kind |= KIND_SHADOW;
                    add_time(&okey, span - on);
                }
            }
        } else if (!(th->flags & TH_CAPTURED) && kept) {
            /* its stack was not taken, and it has run since: not known */
            add_stackless(tgid, prev, th->wait_kind, -1, span - on);
            th->off_ns += span - on;
        }
        th->on_ns += on;
        count_drop(DROP_IN_UNSEEN);
        from = now;
    } else {
        from = ctl->start_ns;       /* its first switch: running since the start */
    }
    th->on_ns += now - from;
    th->exec_ns = exec;
    th->flags = (th->flags & ~(TH_ON | TH_CAPTURED)) | TH_OFF;
    th->ts = now;
    u64 state = ctx->args[3];
    if (th->flags & TH_PENDING)
        owed_at_switch_out(th, prev);
    left_cpu(prev);
    if (state & TASK_DEAD_STATE) {  /* exiting: it will not come back */
        bpf_get_current_comm(&th->comm, sizeof(th->comm));     /* its last name: its group's */
        if (th->flags & TH_PENDING)
            owed_lost(th, prev);        /* it will not return to user space */
        short_flush(th, prev);
        th->flags = (th->flags & ~TH_OFF) | TH_EXITED;
        th->last_ts = now;
        switch_memo.delete(&prev);
        if (th->flags & TH_HELD)
            fold_progs.call(ctx, 0);    /* fold_exit */
        return 0;
    }
    u32 kind = off_cpu_kind(ctx->args[0], state) | (current_syscall() << SYS_SHIFT);
    u32 mode = ctl->offcpu;
    if (mode != OFFCPU_EXACT) {
        /* the wait's kind (and kernel stack) kept for its switch-in, which
         * decides whether its stack is owed */
        if (!(th->flags & (TH_RSEQ | TH_NO_RSEQ)))
            th->flags |= has_rseq() ? TH_RSEQ : TH_NO_RSEQ;
        th->wait_kind = kind;
#if KERNEL_STACKS
        th->wait_kstack = kstacks.get_stackid(ctx, 0);
#else
        th->wait_kstack = -1;
#endif
        if (mode == OFFCPU_SAMPLED && !(th->flags & TH_NO_RSEQ))
            return 0;
    }
    /* OFFCPU_EXACT (and a thread without rseq): the stack now.  As in
     * on_cpu_sample, unwind_tp reuses or walks the native stack and records
     * the interval start.  The thread's name is kept where a stack is taken
     * (a name changes seldom; reading it costs a helper call). */
    th->flags |= TH_CAPTURED;
    bpf_get_current_comm(&th->comm, sizeof(th->comm));
    int slot = 1;
    struct unwind_state *us = unwind_scratch.lookup(&slot);
    if (!us)
        return 0;
    struct stack_key *key = &us->key;
    __builtin_memset(key, 0, sizeof(*key));
    key->kind = kind;
    us->ts = now;
    us->owed = 0;
    capture(ctx, key, tgid, prev, 1, 1);
    unwind_tp_progs.call(ctx, 1);       /* memo_tp */
    struct offcpu_start st = {};        /* the tail call failed */
    st.key = *key;
    st.ts = now;
    if (offcpu_start.update(&prev, &st) != 0)
        count_drop(DROP_START_FULL);
    return 0;
}

/* --- The kernel's fold of ended threads (pyoffcpu.h) --- */

static __always_inline int is_on_cpu(u32 kind)
{
    return (kind & ~(3U << GIL_SHIFT)) == KIND_ONCPU;
}

static __always_inline void agg_add(struct stack_key *k, u64 count, u64 ns)
{
    struct stack_value init = {};
    struct stack_value *v = agg.lookup_or_try_init(k, &init);
    if (!v) {
        count_drop_ns(DROP_AGG_FULL, ns);
        return;
    }
    __sync_fetch_and_add(&v->count, count);
    __sync_fetch_and_add(&v->ns, ns);
}

/* The id of the group of a process, entry stack and name (0: none, the
 * group map is full). */
static __always_inline u32 group_of(u32 tgid, u64 pystack, struct thread_t *th)
{
    int zero = 0;
    struct group_id_key gk = {};
    gk.tgid = tgid;
    gk.pystack = pystack;
    __builtin_memcpy(&gk.comm0, th->comm, 16);
    u32 *id = group_ids.lookup(&gk);
    if (id)
        return *id;
    /* a new id, unique without an atomic whose result is used (the BPF
     * target bcc compiles for has none): this CPU's count, and the CPU */
    u32 cpu = bpf_get_smp_processor_id();
    u64 *made = group_count.lookup(&zero);
    if (!made || cpu > 255)
        return 0;
    *made += 1;
    u32 fresh = (u32)(*made << 8) | cpu;
    if (fresh & GROUP_TID)
        return 0;
    group_ids.insert(&gk, &fresh);     /* another CPU may have made it first */
    id = group_ids.lookup(&gk);
    return id ? *id : 0;
}

/* fold_exit's running values, per CPU.  Kept in a map value, not in
 * registers: the verifier then sees the same unknown values on every path
 * through a loop's body, and prunes (in registers, 32 iterations of three
 * loops passed its million instructions). */
struct fold_state {
    u64 count[MAX_HELD], ns[MAX_HELD];  /* each held key's, read once (ns 0: gone) */
    u64 total, samples;             /* the thread's on-CPU ns and samples */
    u64 exact, left;                /* its exact on-CPU ns; what is left of it to share */
    u64 best;                       /* the Python stack with the most time */
    s64 best_ns;
    u32 last_on;                    /* index of its last on-CPU key (MAX_HELD: none) */
    u32 wall;                       /* FOLD_WALL: on-CPU keys are scaled */
    u32 unknown;                    /* a stack not in stack_class */
    u32 pad;
};
BPF_PERCPU_ARRAY(fold_scratch, struct fold_state, 1);

/* The on-CPU time of held key i once scaled to the thread's exact on-CPU
 * time, as user space scales a thread's samples (ThreadAccounts.scale_on_cpu):
 * ns * exact / total, the rest to the last on-CPU key. */
static __always_inline u64 fold_ns(struct fold_state *fs, u32 i, u32 kind, u64 ns)
{
    if (!fs->wall || !is_on_cpu(kind))
        return ns;
    if (i == fs->last_on)
        return fs->left;
    u64 share = ns * fs->exact / fs->total;     /* < 2^64: both below FOLD_SCALE_MAX */
    fs->left -= share;
    return share;
}

/* Tail-called by sched_switch at the last switch of a thread whose keys are
 * held (TH_HELD): its keys leave GEN_HELD.  Folded (FOLD_WALL / FOLD_OFFCPU):
 * each under its group's tid, the on-CPU ones scaled to the thread's exact
 * on-CPU time, and the thread's times added to the group; its thread entry
 * goes.  Not folded (a key did not fit, times too long for the scaling, no
 * group id left) or FOLD_SHADOW: under its own tid too, for user space,
 * which then closes and folds it as any ended thread.  The group is that of
 * the thread's Python stack with the most time (after the scaling) among
 * those with an entry function, as user space picks it; a thread with a
 * stack user space has not classified yet is left to it. */
int fold_exit(struct bpf_raw_tracepoint_args *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id, tgid = id >> 32;
    int zero = 0;
    struct control_t *ctl = control.lookup(&zero);
    struct thread_t *th = threads.lookup(&tid);
    struct held_t *h = held_keys.lookup(&tid);
    struct fold_state *fs = fold_scratch.lookup(&zero);
    if (!ctl || !th || !h || !fs)
        return 0;
    u32 mode = ctl->fold & FOLD_MODE_MASK;
    u32 n = h->n;
    fs->wall = mode == FOLD_WALL;
    fs->exact = fs->wall ? th->on_ns : 0;
    fs->total = fs->samples = 0;
    fs->last_on = MAX_HELD;
    u32 i;
    /* each key's count and ns; the on-CPU total, the samples, the last on-CPU key */
#pragma clang loop unroll(disable)
    for (i = 0; i < MAX_HELD; i++) {
        if (i >= n)
            break;
        struct stack_value *v = agg.lookup(&h->keys[i]);
        u32 j = i & (MAX_HELD - 1);
        fs->count[j] = v ? v->count : 0;
        fs->ns[j] = v ? v->ns : 0;
        if (!v || !is_on_cpu(h->keys[i].kind))
            continue;
        fs->total += v->ns;
        fs->samples += v->count;
        fs->last_on = i;
    }
    int fold = mode && !h->overflow && fs->exact < FOLD_SCALE_MAX && fs->total < FOLD_SCALE_MAX;
    /* the heaviest Python stack that has an entry function, the first of
     * equals, as user space picks it (ThreadAccounts.fold) */
    fs->best = 0;
    fs->best_ns = -1;
    fs->unknown = 0;
    fs->left = fs->exact;
#pragma clang loop unroll(disable)
    for (i = 0; fold && i < MAX_HELD; i++) {
        if (i >= n)
            break;
        u32 j = i & (MAX_HELD - 1);
        u64 py = h->keys[j].pystack;
        if (!fs->count[j] && !fs->ns[j])
            continue;                   /* gone (cannot happen: the thread's own) */
        s64 ns = fold_ns(fs, i, h->keys[j].kind, fs->ns[j]);
        if (!py)
            continue;
        u8 *c = stack_class.lookup(&py);
        if (!c) {
            fs->unknown = 1;            /* user space has not seen it yet */
            continue;
        }
        if (*c == STACK_ENTRY && ns > fs->best_ns) {
            fs->best_ns = ns;
            fs->best = py;
        }
    }
    if (fs->unknown)
        fold = 0;
    u32 gid = fold ? group_of(tgid, fs->best, th) : 0;
    if (!gid)
        fold = 0;
    int own = !fold || (ctl->fold & FOLD_SHADOW);
    u32 gen = ctl->gen;
    fs->left = fs->exact;
#pragma clang loop unroll(disable)
    for (i = 0; i < MAX_HELD; i++) {
        if (i >= n)
            break;
        u32 j = i & (MAX_HELD - 1);
        u64 count = fs->count[j], ns = fs->ns[j];
        if (!count && !ns)
            continue;
        struct stack_key d;
        __builtin_memcpy(&d, &h->keys[j], sizeof(d));
        agg.delete(&d);
        d.gen = gen;
        if (own)
            agg_add(&d, count, ns);
        if (fold) {
            d.tid = GROUP_TID | gid;
            agg_add(&d, count, fold_ns(fs, i, d.kind, ns));
        }
    }
    if (fold) {
        /* what user space adds at a thread's end (close_thread, scale_on_cpu) */
        struct stack_key d = {};
        d.tgid = tgid;
        d.tid = GROUP_TID | gid;
        d.kstack = -1;
        d.gen = gen;
        if (th->unseen_ns) {
            d.ustack = USTACK_NO_STACK;
            d.kind = KIND_OTHER;
            agg_add(&d, 1, th->unseen_ns);
        }
        if (fs->wall && fs->total == 0 && fs->exact > 0) {
            d.ustack = USTACK_UNSAMPLED;
            d.kind = KIND_ONCPU;
            agg_add(&d, 0, fs->exact);
        }
        struct group_key gk = {};
        gk.id = gid;
        gk.gen = gen;
        gk.cpu = bpf_get_smp_processor_id();
        struct group_t blank = {};
        struct group_t *g = groups.lookup_or_try_init(&gk, &blank);
        if (g) {
            u64 first = th->first_ts ? th->first_ts : th->last_ts;
            if (!g->threads || first < g->first_ts) {
                g->first_ts = first;
                g->first_tid = tid;
            }
            if (th->last_ts > g->last_ts)
                g->last_ts = th->last_ts;
            g->threads += 1;
            g->on_ns += fs->exact;
            g->samples += fs->samples;
        }
    }
    if (own)                            /* user space's to close */
        th->flags = (th->flags & ~TH_HELD) | (fold ? TH_KFOLDED : 0);
    else
        threads.delete(&tid);
    held_keys.delete(&tid);
    return 0;
}

/* One entry of the life log (pyoffcpu.h). */
static __always_inline void log_life(u32 kind, u32 tgid, u64 arg)
{
    int zero = 0;
    u64 *total = life_total.lookup(&zero);
    if (!total)
        return;
    u64 idx = __sync_fetch_and_add(total, 1);
    u32 slot = idx & (LIFE_LOG - 1);
    struct life_event *e = life_log.lookup(&slot);
    if (!e)
        return;
    e->seq = 0;
    asm volatile("" ::: "memory");  /* x86_64 keeps stores in order; so must clang */
    e->kind = kind;
    e->tgid = tgid;
    e->arg = arg;
    asm volatile("" ::: "memory");
    e->seq = idx + 1;
}

/* tgid is a new image (an exec, or a new process under a target's PID):
 * user space looks at it again. */
static __always_inline void new_image(u32 tgid)
{
    execs.atomic_increment(tgid);
    u64 *n = execs.lookup(&tgid);
    log_life(LIFE_EXEC, tgid, n ? *n : 0);
}

/* A target starts a thread: register it, so that its first switch-in is
 * seen.  Active from registration on, so that no thread started between the
 * listing of a target's threads and the start is missed.  A child process
 * (another tgid) is not a target. */
/* A thread started (in the forking thread's context: its name is the
 * parent's until it sets its own).  A reused tid replaces the entry of the
 * thread that had it. */
static __always_inline void born_thread(struct control_t *ctl, u32 tid, u32 tgid)
{
    struct thread_t fresh = {};
    fresh.tgid = tgid;
    fresh.flags = ctl->start_ns ? TH_BORN : 0;
    if (ctl->start_ns && ctl->fold) {
        /* its keys held for the kernel's fold from its first event on */
        int zero = 0;
        struct held_t *blank = held_zero.lookup(&zero);
        if (blank && held_keys.update(&tid, blank) == 0)
            fresh.flags |= TH_HELD;
    } else {
        held_keys.delete(&tid);     /* a reused tid's, left by a thread not folded */
    }
    bpf_get_current_comm(&fresh.comm, sizeof(fresh.comm));
    if (threads.update(&tid, &fresh) != 0)
        count_drop(DROP_THREADS_FULL);
    switch_memo.delete(&tid);
}

/* --subprocesses: a target forked a process.  The child is a copy of its
 * image (same interpreter, same offsets, same mappings), so it gets the
 * parent's registration and unwind tables before its first instruction, and
 * a thread entry; user space is told through `forks`.  An exec later makes
 * it a new image like any target's. */
static __always_inline void follow_child(struct control_t *ctl, u32 tgid, u32 ctgid)
{
    struct proc_info *ppi = procs.lookup(&tgid);
    struct proc_info info = {};
    info.walker = WALK_NONE;
    if (ppi)
        __builtin_memcpy(&info, ppi, sizeof(info));
    procs.update(&ctgid, &info);
    struct proc_unwind *pu = unwind_procs.lookup(&tgid);
    if (pu)
        unwind_procs.update(&ctgid, pu);
    born_thread(ctl, ctgid, ctgid);
    u64 *pexecs = execs.lookup(&tgid);
    u64 parent = tgid | ((pexecs ? *pexecs : 0) << 32);
    forks.update(&ctgid, &parent);
    log_life(LIFE_FORK, ctgid, parent);
}

RAW_TRACEPOINT_PROBE(sched_process_fork)
{
    int zero = 0;
    struct control_t *ctl = control.lookup(&zero);
    if (!ctl || (ctl->end_ns && bpf_ktime_get_ns() >= ctl->end_ns))
        return 0;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u64 child = ctx->args[1];
    u32 ctgid = 0, ctid = 0;
    bpf_probe_read_kernel(&ctgid, sizeof(ctgid), (void *)(child + TASK_TGID_OFF));
    bpf_probe_read_kernel(&ctid, sizeof(ctid), (void *)(child + TASK_PID_OFF));
    if (ctid != 0 && ctgid == ctid) {
        /* A new process.  If its PID was a target's, that process is gone
         * and its registration is stale: never walk this one with it. */
        struct proc_info *pi = procs.lookup(&ctgid);
        if (pi) {
            pi->walker = WALK_NONE;
            unwind_procs.delete(&ctgid);
            new_image(ctgid);
        }
        if (ctl->follow && is_target(ctl, tgid))
            follow_child(ctl, tgid, ctgid);
        return 0;
    }
    if (!is_target(ctl, tgid))
        return 0;
    if (ctgid != tgid || ctid == 0)
        return 0;
    born_thread(ctl, ctid, tgid);
    return 0;
}

/* A target calls exec: its CPython layouts and unwind tables are the old
 * image's.  Walk it natively, without tables, until user space has read the
 * new image (it watches `execs`). */
RAW_TRACEPOINT_PROBE(sched_process_exec)
{
    int zero = 0;
    struct control_t *ctl = control.lookup(&zero);
    if (!ctl)
        return 0;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (is_target(ctl, tgid)) {
        struct proc_info *pi = procs.lookup(&tgid);
        if (pi)
            pi->walker = WALK_NONE;
        unwind_procs.delete(&tgid);
        u32 tid = (u32)bpf_get_current_pid_tgid();
        struct thread_t *th = threads.lookup(&tid);
        if (th)                     /* the new program's name */
            bpf_get_current_comm(&th->comm, sizeof(th->comm));
    } else if (!ctl->discover) {
        return 0;
    }
    new_image(tgid);
    return 0;
}

/* A registered process's last thread exits: user space retires it now
 * (its tables go, its PID may be another's next).  Where the tracepoint has
 * no group_dead (older kernels), the group leader's exit stands in and
 * user space's liveness checks catch the rest. */
RAW_TRACEPOINT_PROBE(sched_process_exit)
{
    if (!last_thread_exits(ctx))
        return 0;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!procs.lookup(&tgid))
        return 0;
    unwind_procs.delete(&tgid);
    log_life(LIFE_EXIT, tgid, 0);
    return 0;
}

#if WAKERS
/* Interrupt context, per CPU: a wakeup inside it is not its `current`'s. */
static __always_inline void irq_move(int which, int by)
{
    u32 *d = irq_depth.lookup(&which);
    if (!d)
        return;
    if (by > 0)
        *d += 1;
    else if (*d > 0)
        *d -= 1;
}
/* Attached by the session (Session._attach, in WAKE_ATTACH's order), every
 * exit before any entry: an entry that fired while its exit was not
 * attached yet would leave its CPU "in an interrupt" for good, and every
 * wakeup on it a timer's.  irq_handler_* and softirq_* share wake_irq_*,
 * hrtimer_expire_* wake_timer_*. */
int wake_irq_enter(struct bpf_raw_tracepoint_args *ctx) { irq_move(0, 1); return 0; }
int wake_irq_leave(struct bpf_raw_tracepoint_args *ctx) { irq_move(0, -1); return 0; }
int wake_timer_enter(struct bpf_raw_tracepoint_args *ctx) { irq_move(1, 1); return 0; }
int wake_timer_leave(struct bpf_raw_tracepoint_args *ctx) { irq_move(1, -1); return 0; }

/* The waker of s->wakee, its stacks taken (s->key: the waker's): kept as
 * that thread's last waker. */
static __always_inline void wake_recorded(struct unwind_state *s)
{
    struct waker_t w = {};
    w.ts = s->ts;
    w.kind = s->key.kind & 0xff;    /* capture() added the waker's GIL state */
    w.tgid = s->key.tgid;
    w.tid = s->key.tid;
    w.ustack = s->key.ustack;
    w.kstack = s->key.kstack;
    w.pystack = s->key.pystack;
    w.nstack = s->key.nstack;
    if (w.kind == WAKER_TASK)
        bpf_get_current_comm(&w.comm, sizeof(w.comm));
    u32 wakee = s->wakee;
    last_waker.update(&wakee, &w);
}

/* --wakers: a thread is woken.  Runs in the waker's context (sched_wakeup
 * may run on the wakee's CPU: not used), with interrupts off (p->pi_lock).
 * Bystanders cost the target test only: the wakee's tgid against the inline
 * target list.  A waker in a target process gets its stacks taken as a
 * switch-out's are (capture, then memo_wake / unwind_wake for the native
 * walk, reused as at a switch-out); one in another process its kernel
 * stack only (its mappings are not known). */
RAW_TRACEPOINT_PROBE(sched_waking)
{
    int zero = 0;
    struct control_t *ctl = control.lookup(&zero);
    if (!ctl || !ctl->start_ns)
        return 0;
    u64 p = ctx->args[0];
    u32 wtgid = 0, wtid = 0;
    bpf_probe_read_kernel(&wtgid, sizeof(wtgid), (void *)(p + TASK_TGID_OFF));
    if (!wtgid || !is_target(ctl, wtgid))
        return 0;
    bpf_probe_read_kernel(&wtid, sizeof(wtid), (void *)(p + TASK_PID_OFF));
    int slot = 2;
    struct unwind_state *us = unwind_scratch.lookup(&slot);
    if (!us)
        return 0;
    struct stack_key *key = &us->key;
    __builtin_memset(key, 0, sizeof(*key));
    key->ustack = key->kstack = -1;
    us->ready = 0;
    us->wakee = wtid;
    us->ts = bpf_ktime_get_ns();
    int one = 1;
    u32 *timer = irq_depth.lookup(&one);
    u32 *irq = irq_depth.lookup(&zero);
    if (timer && *timer) {
        key->kind = WAKER_TIMER;
    } else if (irq && *irq) {
        key->kind = WAKER_IRQ;
    } else {
        u64 id = bpf_get_current_pid_tgid();
        u32 tgid = id >> 32;
        key->kind = WAKER_TASK;     /* before the tail call: it does not return */
        if (procs.lookup(&tgid)) {
            capture(ctx, key, tgid, (u32)id, 2, 1);
            unwind_wake_progs.call(ctx, 1);     /* memo_wake */
            us->ready = 0;          /* the tail call failed: no native stack */
        } else {
            key->tgid = tgid;
            key->tid = (u32)id;
#if KERNEL_STACKS
            key->kstack = kstacks.get_stackid(ctx, 0);
#endif
        }
    }
    wake_recorded(us);
    return 0;
}
#endif
