/* What a switch does to a target thread's wait: its end closes it, with
 * the stack taken at its switch-out (OFFCPU_EXACT) or, by threshold
 * sampling, with a stack owed to it (OFFCPU_SAMPLED, pyoffcpu.h), taken on
 * the thread's way back to user space by rseq_capture.  Pasted into
 * pyoffcpu.bpf.c by the loader (bcc rewrites map calls only in the main
 * file), where sched_switch's helpers go; docs/offcpu-sampling.md. */

/* Is a wait this long left out (--min-block-us / --max-block-us)?  Then
 * counted (block_filtered) with ns, its part inside the recording. */
static __always_inline int left_out(struct control_t *ctl, u64 len, u64 ns)
{
    if (len >= ctl->min_block_ns && !(ctl->max_block_ns && len > ctl->max_block_ns))
        return 0;
    int i = 0;
    u64 *n = block_filtered.lookup(&i);
    if (n)
        *n += 1;
    i = 1;
    n = block_filtered.lookup(&i);
    if (n)
        *n += ns;
    return 1;
}

/* Time of tid's without a stack: key kind, ustack USTACK_NO_STACK. */
static __always_inline void add_stackless(u32 tgid, u32 tid, u32 kind, int kstack, u64 ns)
{
    struct stack_key key = {};
    key.tgid = tgid;
    key.tid = tid;
    key.ustack = USTACK_NO_STACK;
    key.kstack = kstack;
    key.kind = kind;
    add_time(&key, ns);
}

/* A wait's stack that will not be taken: its weight is kept without one,
 * and counted (wait stack not taken). */
static __always_inline void capture_lost(u32 tgid, u32 tid, u32 kind, int kstack, u64 ns)
{
    add_stackless(tgid, tid, kind, kstack, ns);
    count_drop_ns(DROP_CAPTURE_LOST, ns);
}

/* The capture owed to a thread (TH_PENDING) will not be taken. */
static __always_inline void owed_lost(struct thread_t *th, u32 tid)
{
    th->flags &= ~TH_PENDING;
    capture_lost(th->tgid, tid, th->pend_kind, th->pend_kstack, th->pend_ns);
}

/* A stack is owed for a wait of the thread that just ended (OFFCPU_SAMPLED):
 * key kind, weight ns.  One still owed means the thread has not been back
 * in user space since that earlier wait ended (it blocked again in the
 * kernel): its user stack is the same, so one capture serves both when they
 * are of one kind; otherwise the lighter of the two is kept without a stack
 * (a preemption sampled at weight T just after a 200 ms wait ended must not
 * cost that wait its stack). */
static __always_inline void owe_capture(struct thread_t *th, u32 tid, u32 kind, u64 ns, u64 from)
{
    if (th->flags & TH_PENDING) {
        if (th->pend_kind == kind) {
            th->pend_ns += ns;
            return;
        }
        if (th->pend_ns >= ns) {    /* the heavier is the one kept */
            capture_lost(th->tgid, tid, kind, th->wait_kstack, ns);
            return;
        }
        owed_lost(th, tid);
    }
    th->pend_kind = kind;
    th->pend_ns = ns;
    th->pend_from = from;
    th->pend_kstack = th->wait_kstack;
    th->pend_rounds = 0;
    th->flags |= TH_PENDING;
}

/* A wait ends, its stack taken at its switch-out (TH_CAPTURED: offcpu_start
 * holds its key): its time goes to that key. */
static __always_inline void exact_close(void *ctx, struct control_t *ctl, struct thread_t *th, u32 tid,
                                        u64 now)
{
    struct offcpu_start *st = offcpu_start.lookup(&tid);
    if (!st) {
        count_drop_ns(DROP_START_FULL, now - th->ts);   /* its stack was lost */
        return;
    }
    struct stack_key key;
    open_key(tid, st, &key);
    u64 from = st->ts > ctl->start_ns ? st->ts : ctl->start_ns;
    u64 ns = now - from;
    u64 len = now - st->ts;         /* the whole wait, from before the start too */
    offcpu_start.delete(&tid);
    if (left_out(ctl, len, ns))
        return;
    add_time(&key, ns);
    th->off_ns += ns;
    if (WAKERS)
        add_wake(tid, st->ts, &key, ns);
    if (TIMELINE && len >= ctl->timeline_min_ns)
        timeline_send(ctx, &key, st->ts, now, th->comm);
}

/* The agg key of slot i of the thread's KIND_SHORT totals (here and in
 * fold_exit, which adds them to the thread's group). */
static __always_inline void short_key(struct thread_t *th, u32 tid, u32 i,
                                      struct stack_key *key)
{
    __builtin_memset(key, 0, sizeof(*key));
    key->tgid = th->tgid;
    key->tid = tid;
    key->ustack = USTACK_SHORT;
    key->kstack = -1;
    key->kind = th->short_kind[i & (SHORT_SLOTS - 1)] | KIND_SHORT;
}

/* Slot i of the thread's KIND_SHORT totals kept in its entry goes to agg. */
static __always_inline void short_flush_slot(struct thread_t *th, u32 tid, u32 i)
{
    i &= SHORT_SLOTS - 1;
    if (!th->short_n[i])
        return;
    struct stack_key key;
    short_key(th, tid, i, &key);
    add_time_n(&key, th->short_n[i], th->short_ns[i]);
    th->short_n[i] = 0;
    th->short_ns[i] = 0;
}

/* All of them (the thread's last switch-out). */
static __always_inline void short_flush(struct thread_t *th, u32 tid)
{
    for (u32 i = 0; i < SHORT_SLOTS; i++)
        short_flush_slot(th, tid, i);
}

/* A short wait's time into its thread's KIND_SHORT total of its kind, kept
 * in the thread's entry: one slot per kind, SHORT_SLOTS kinds at a time (a
 * hash update in agg at every wait was most of a switch's cost, and the
 * waits of a thread that serves a request alternate between a few kinds:
 * accept, recv, a lock).  A kind that finds every slot taken by others
 * sends one of them to agg first; a slot goes there too once it holds
 * SHORT_FLUSH_NS.  Exact either way: only when the time reaches agg moves. */
static __always_inline void short_add(struct thread_t *th, u32 tid, u32 kind, u64 ns)
{
    u32 slot = SHORT_SLOTS, free = SHORT_SLOTS;
#pragma unroll
    for (u32 i = 0; i < SHORT_SLOTS; i++) {
        if (th->short_n[i]) {
            if (th->short_kind[i] == kind)
                slot = i;
        } else if (free == SHORT_SLOTS) {
            free = i;
        }
    }
    if (slot == SHORT_SLOTS) {
        if (free == SHORT_SLOTS) {
            /* every slot holds another kind: the one this kind hashes to goes */
            free = (kind * 2654435761U) >> (32 - SHORT_SLOTS_LOG2);
            short_flush_slot(th, tid, free);
        }
        slot = free & (SHORT_SLOTS - 1);
        th->short_kind[slot] = kind;
    }
    slot &= SHORT_SLOTS - 1;
    th->short_n[slot] += 1;
    th->short_ns[slot] += ns;
    if (th->short_ns[slot] >= SHORT_FLUSH_NS)
        short_flush_slot(th, tid, slot);
}

/* A wait ends whose stack was not taken (OFFCPU_SAMPLED; OFFCPU_SHADOW's
 * second view, flag KIND_SHADOW): its time is exact; its stack is owed by
 * threshold sampling with period T: a wait of d >= T always, at weight d; a
 * shorter one with probability d/T, at weight T, its d added to the
 * thread's KIND_SHORT total of its kind all the same (user space splits that
 * total over the sampled stacks).  Unbiased for every stack, never more
 * variance than a wall-clock sampler at 1/T, and every long wait exact. */
static __always_inline void sampled_close(struct control_t *ctl, struct thread_t *th, u32 tid, u64 now,
                                          u32 flag)
{
    u64 from = th->ts > ctl->start_ns ? th->ts : ctl->start_ns;
    u64 ns = now - from;
    u64 len = now - th->ts;
    if (flag) {                     /* the exact view counted it */
        if (len < ctl->min_block_ns || (ctl->max_block_ns && len > ctl->max_block_ns))
            return;
    } else {
        if (left_out(ctl, len, ns))
            return;
        th->off_ns += ns;
    }
    u32 kind = th->wait_kind | flag;
    if (ns >= SAMPLE_PERIOD_NS) {
        owe_capture(th, tid, kind, ns, th->ts);
        return;
    }
    short_add(th, tid, kind, ns);
    /* uniform in [0, T): below ns with probability ns/T */
    if ((((u64)bpf_get_prandom_u32() * SAMPLE_PERIOD_NS) >> 32) < ns)
        owe_capture(th, tid, kind | KIND_SAMPLED, SAMPLE_PERIOD_NS, th->ts);
}

/* Per CPU: the target thread sched_switch last put on it, and whether a
 * capture is owed to it (taken when it returns to user space: rseq_capture). */
struct switched_in_t {
    u32 tid;
    u32 owed;
};
BPF_PERCPU_ARRAY(switched_in, struct switched_in_t, 1);

static __always_inline void note_switched_in(u32 tid, u32 owed)
{
    int zero = 0;
    struct switched_in_t *s = switched_in.lookup(&zero);
    if (s) {
        s->tid = tid;
        s->owed = owed;
    }
}

/* next (its task_struct at task) goes on a CPU: close the interval it
 * spent off it. */
static __always_inline void switch_in(void *ctx, struct control_t *ctl, u32 tid, u64 now, u64 task)
{
    struct thread_t *th = threads.lookup(&tid);
    if (!th) {
        count_drop(DROP_NO_THREAD);
        return;
    }
    /* Its runtime (se.sum_exec_runtime) as it goes on the CPU: what it was
     * at its switch-out, which left it in exec_ns, unless that was not seen
     * (or this is its first event): then read. */
    if ((th->flags & TH_ON) || !th->exec_ns) {
        u64 exec = task_u64(task, TASK_EXEC_OFF);
        if (th->flags & TH_ON) {
            /* On a CPU since its last switch-in, yet switched in again: its
             * switch-out was not seen.  Its runtime tells how much of the
             * span it ran; the rest was off-CPU, with no stack. */
            u64 span = now - th->ts;
            u64 on = exec > th->exec_ns ? exec - th->exec_ns : 0;
            if (on > span)
                on = span;
            th->on_ns += on;
            th->unseen_ns += span - on;
            count_drop_ns(DROP_OUT_UNSEEN, span - on);
        }
        th->exec_ns = exec;
    }
    if (!th->first_ts) {
        th->first_ts = now;
        th->flags |= TH_FIRST_IN;
    }
    if (th->flags & TH_OFF) {
        u32 captured = th->flags & TH_CAPTURED;
        if (captured)
            exact_close(ctx, ctl, th, tid, now);
        if (ctl->offcpu != OFFCPU_EXACT && (!captured || ctl->offcpu == OFFCPU_SHADOW))
            sampled_close(ctl, th, tid, now, captured ? KIND_SHADOW : 0);
    }
    note_switched_in(tid, th->flags & TH_PENDING);
    th->flags = (th->flags & ~(TH_OFF | TH_CAPTURED)) | TH_ON;
    th->ts = now;
}

/* Does the current thread have rseq registered (glibc >= 2.35 registers it
 * for every thread)?  Then the kernel runs rseq_update for it on every
 * return to user space after a switch.  (User space samples waits only
 * where it knows the offset.) */
static __always_inline int has_rseq(void)
{
    s64 off = TASK_RSEQ_OFF;
    if (off < 0)
        return 0;
    u64 area = 0;
    bpf_probe_read_kernel(&area, sizeof(area), (void *)(bpf_get_current_task() + off));
    return area != 0;
}

/* tid leaves the CPU (its switch-out; the switch-in of next, done first,
 * may have put next there already). */
static __always_inline void left_cpu(u32 tid)
{
    int zero = 0;
    struct switched_in_t *s = switched_in.lookup(&zero);
    if (s && s->tid == tid) {
        s->tid = 0;
        s->owed = 0;
    }
}

/* A capture is still owed at the thread's next switch-out: rseq_capture did
 * not take it.  If the thread was put on this CPU with it owed and has not
 * been back to user space since (switched_in still names it, owed: the
 * return clears that), it blocked again in the kernel (preempted on its way
 * out, a wait that sleeps twice): its user stack is still the one it
 * blocked with, and the capture waits for its return, MAX_PEND_ROUNDS
 * switches at most.  Otherwise it went back to user space without
 * rseq_update: that stack is gone, the weight is kept without one, and the
 * thread's waits are captured at their switch-outs from now on. */
static __always_inline void owed_at_switch_out(struct thread_t *th, u32 tid)
{
    int zero = 0;
    struct switched_in_t *s = switched_in.lookup(&zero);
    int in_kernel = s && s->tid == tid && s->owed;
    if (in_kernel && th->pend_rounds < MAX_PEND_ROUNDS) {
        th->pend_rounds += 1;
        return;
    }
    owed_lost(th, tid);
    th->flags |= TH_NO_RSEQ;
}

/* An owed capture taken (rseq_capture, then memo_tp / unwind_tp for the
 * native stack): its weight goes to the key.  From bpf/memo.c. */
static __always_inline void owed_recorded(struct unwind_state *s)
{
    s->owed = 0;
    add_time(&s->key, s->owed_ns);
    if (WAKERS && !(s->key.kind & KIND_SHADOW))
        add_wake(s->key.tid, s->ts, &s->key, s->owed_ns);
}

/* Attached to rseq_update (OFFCPU_SAMPLED and OFFCPU_SHADOW): the kernel
 * updates a thread's rseq area on its way back to user space after every
 * switch, in the thread's own context, before it runs a user instruction.
 * The thread sched_switch last put on this CPU (switched_in) is the one
 * returning, and when a capture is owed to it, its user stack and Python
 * frames are still those it blocked with: they are taken here, as a
 * switch-out's are.  Any other thread is a bystander (it returns after the
 * target test), or a target whose switch-in sched_switch never saw (it
 * happens: the tracepoint does not fire for some switches on some kernels):
 * its stack is the one of the wait still open, taken now into offcpu_start
 * as --off-cpu exact would have at the switch-out, and its next switch-out
 * closes that wait with it. */
int rseq_capture(struct bpf_raw_tracepoint_args *ctx)
{
    int zero = 0;
    struct switched_in_t *last = switched_in.lookup(&zero);
    if (!last)
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id, tgid = id >> 32;
    struct control_t *ctl;
    struct thread_t *th;
    int owed = last->tid == tid;
    if (owed) {
        if (!last->owed)
            return 0;
        last->tid = 0;              /* back in user space (owed_at_switch_out) */
        last->owed = 0;
        th = threads.lookup(&tid);
        if (!th || !(th->flags & TH_PENDING))
            return 0;
        /* from the end mark on, user space keeps what is still owed */
        ctl = control.lookup(&zero);
        if (!ctl || (ctl->end_ns && bpf_ktime_get_ns() >= ctl->end_ns))
            return 0;
        th->flags = (th->flags & ~TH_PENDING) | TH_RSEQ;
    } else {
        ctl = control.lookup(&zero);
        if (!ctl || !is_target(ctl, tgid))
            return 0;
        th = threads.lookup(&tid);
        if (!th || (th->flags & (TH_OFF | TH_CAPTURED)) != TH_OFF || !recording_at(ctl, bpf_ktime_get_ns()))
            return 0;
        if (th->flags & TH_PENDING) {
            /* A capture still owed for the wait before this one: the thread
             * has not been in user space since that wait ended (its
             * switch-out kept it owed: owed_at_switch_out), so its user
             * stack is that wait's, and the owed one is taken (a whole
             * wait's weight: a 200 ms lock wait lost this way in a CI run).
             * The open wait's span goes without a stack at the next
             * switch-out, which finds its switch-in unseen. */
            owed = 1;
            th->flags = (th->flags & ~TH_PENDING) | TH_RSEQ;
        } else {
            th->flags |= TH_CAPTURED;
            count_drop(DROP_IN_LATE);
        }
    }
    bpf_get_current_comm(&th->comm, sizeof(th->comm));
    int slot = 1;                   /* sched_switch's: never runs beside this on the CPU */
    struct unwind_state *us = unwind_scratch.lookup(&slot);
    if (!us)
        return 0;
    struct stack_key *key = &us->key;
    __builtin_memset(key, 0, sizeof(*key));
    key->kind = owed ? th->pend_kind : th->wait_kind;
    key->kstack = owed ? th->pend_kstack : th->wait_kstack;
    us->ts = owed ? th->pend_from : th->ts;
    us->owed = owed;
    us->owed_ns = th->pend_ns;
    capture(ctx, key, tgid, tid, 1, 0);
    unwind_tp_progs.call(ctx, 1);       /* memo_tp */
    switch_recorded(us);                /* the tail call failed */
    return 0;
}
