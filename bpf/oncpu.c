/* pyoffcpu.bpf.c's part: a stack's capture (capture, add_time, the thread's
 * entry) and the on-CPU sampler (on_cpu_sample, perf_event cpu-clock).
 * Pasted into pyoffcpu.bpf.c by the loader (bcc rewrites map calls only in
 * the main file). */

/* Fill key for the current thread; sends a Python stack seen for the first
 * time.  kernel: take the kernel stack (KERNEL_STACKS) too; 0 leaves key->kstack. */
static __always_inline void capture(void *ctx, struct stack_key *key, u32 tgid, u32 tid, int slot,
                                    int kernel)
{
    key->tgid = tgid;
    key->tid = tid;
    key->ustack = -1;
    /* Walked from .eh_frame tables by the finishing program (bpf/unwind.c),
     * once the Python walk is done; frame pointers otherwise. */
    if (!unwind_prepare(tgid, slot)) {
        key->ustack = ustacks.get_stackid(ctx, BPF_F_USER_STACK);
        if (key->ustack < 0)
            count_drop(DROP_USTACK);
    }
    key->nstack = 0;
    if (kernel && KERNEL_STACKS) {
        key->kstack = kstacks.get_stackid(ctx, 0);
        if (key->kstack < 0 && key->kstack != -14)  /* -EFAULT: sampled in user mode */
            count_drop(DROP_KSTACK);
    } else if (kernel) {
        key->kstack = -1;
    }
    key->pystack = 0;
    struct proc_info *pi = procs.lookup(&tgid);
    if (!pi) {
        if (!SYSTEM_WIDE)
            return;
        u64 *n = unregistered.lookup(&tgid);
        if (n) {
            __sync_fetch_and_add(n, 1);
        } else {
            u64 one = 1;
            if (unregistered.insert(&tgid, &one) == 0)
                loop_wakes.perf_submit(ctx, &tgid, sizeof(tgid));
        }
        return;
    }
    struct pystack *st = scratch.lookup(&slot);
    if (!st)
        return;
    u64 thread_ptr = 0;
    u64 tstate = pi->walker != WALK_NONE ? current_tstate(pi, &thread_ptr) : 0;
    key->kind |= gil_state(pi, tstate) << GIL_SHIFT;
    u64 h = walk_python(pi, st, tgid, tstate, slot, thread_ptr);
    key->pystack = h;
    if (!h)
        return;
    if (pystack_seen.lookup(&h))
        return;
    u8 one = 1;
    if (pystack_seen.insert(&h, &one) != 0)
        count_drop(DROP_PYSTACK_FULL);
    /* not sent (a full ring says so with a lost record; a nested program's
     * send fails with no trace): sent again at its next use, not lost for
     * the rest of the recording */
    if (pystack_events.perf_submit(ctx, st, sizeof(*st)) != 0)
        pystack_seen.delete(&h);
}

static __always_inline int is_target(struct control_t *ctl, u32 tgid)
{
    if (SYSTEM_WIDE)
        return tgid != ctl->self_tgid;
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
}

/* A held key's place in its thread's held_keys entry: looked for in
 * HELD_PROBES slots of the entry's index from its hash's (linear probing;
 * nothing is ever taken out of an index, so a key is in the first free
 * slot's run or nowhere), and put in the first free one if not there.
 * Its place, or MAX_HELD: not there and no room (a full index run, or
 * MAX_HELD keys already). */
static __always_inline u32 held_place(struct held_t *h, struct stack_key *key)
{
    u64 *w = (u64 *)key;
    u64 x = w[0];
    x = x * 0x9E3779B97F4A7C15ULL + w[1];
    x = x * 0x9E3779B97F4A7C15ULL + w[2];
    x = x * 0x9E3779B97F4A7C15ULL + w[3];
    x = x * 0x9E3779B97F4A7C15ULL + w[4];
    u32 at = (u32)(x >> 40);
#pragma clang loop unroll(disable)
    for (int p = 0; p < HELD_PROBES; p++) {
        u32 s = (at + p) & (HELD_SLOTS - 1);
        u32 i = h->slot[s];
        if (i == 0) {
            u32 n = h->n;
            if (n >= MAX_HELD)
                return MAX_HELD;
            n &= MAX_HELD - 1;
            __builtin_memcpy(&h->keys[n], key, sizeof(*key));
            h->vals[n].count = 0;
            h->vals[n].ns = 0;
            h->n = n + 1;
            h->slot[s] = n + 1;
            return n;
        }
        u64 *o = (u64 *)&h->keys[(i - 1) & (MAX_HELD - 1)];
        if (o[0] == w[0] && o[1] == w[1] && o[2] == w[2] && o[3] == w[3] && o[4] == w[4])
            return (i - 1) & (MAX_HELD - 1);
    }
    return MAX_HELD;
}

/* Add count events of ns to the key's entry.  A thread whose keys are held
 * for the kernel's fold (held_keys) keeps them and their times in its
 * entry there (gen GEN_HELD); the one that would not fit ends the holding
 * (the thread goes to user space, the keys made from then on to agg and
 * the drains). */
static __always_inline void add_time_n(struct stack_key *key, u64 count, u64 ns)
{
    int zero = 0;
    struct control_t *ctl = control.lookup(&zero);
    if (!ctl)
        return;
    key->gen = ctl->gen;
    if (ctl->fold) {
        u32 tid = key->tid;
        struct held_t *h = held_keys.lookup(&tid);
        if (h && !h->overflow) {
            key->gen = GEN_HELD;
            u32 i = held_place(h, key);
            if (i < MAX_HELD) {
                __sync_fetch_and_add(&h->vals[i].count, count);
                __sync_fetch_and_add(&h->vals[i].ns, ns);
                return;
            }
            h->overflow = 1;
            key->gen = ctl->gen;
        }
    }
    struct stack_value init = {};
    struct stack_value *v = agg.lookup_or_try_init(key, &init);
    if (!v) {
        count_drop_ns(DROP_AGG_FULL, ns);
        return;
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
     * (unwind_perf, bpf/unwind.c) walks the native stack and adds the
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
 * and its error code in orig_ax, an interrupt ~vector (< 0).  Three loads
 * from pt_regs (offsets from BTF: SYS_REGS_*_OFF; bpf_task_pt_regs gives a
 * pointer the verifier types), or, without KERNEL_CAST, one helper read from
 * ax to cs; no user memory: the instruction before the user pc, read here
 * before, was a third of a switch-out's cost. */
#define NEG_ENOSYS (-38)
static __always_inline u32 current_syscall(void)
{
    /* ax, orig_ax and cs in one read: within 128 bytes, in that order
     * (the loader checks; the offsets are constants to the verifier) */
    u64 ax_off = SYS_REGS_AX_OFF;
    u64 nr_word = (SYS_REGS_ORIG_AX_OFF - ax_off) / 8;
    u64 cs_word = (SYS_REGS_CS_OFF - ax_off) / 8;
    if (nr_word > 15 || cs_word > 15)
        return 0;
    struct task_struct *task = bpf_get_current_task_btf();
    u64 regs = bpf_task_pt_regs(task);
    if (!regs)
        return 0;
    s64 ax, nr;
    u64 cs;
    if (KERNEL_CAST) {
        ax = *(volatile s64 *)(regs + ax_off);
        nr = *(volatile s64 *)(regs + SYS_REGS_ORIG_AX_OFF);
        cs = *(volatile u64 *)(regs + SYS_REGS_CS_OFF);
    } else {
        u64 r[16];
        if (bpf_probe_read_kernel(r, (cs_word + 1) * 8, (void *)(regs + ax_off)) != 0)
            return 0;
        ax = (s64)r[0];
        nr = (s64)r[nr_word];
        cs = r[cs_word];
    }
    if ((cs & 3) != 3)
        return 0;
    if (ax != NEG_ENOSYS || nr < 0 || nr >= SYS_OUTSIDE - 1)
        return SYS_OUTSIDE;
    return (u32)nr + 1;
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
