/* pyoffcpu.bpf.c's part: sched_switch, the exact times of every switch of a
 * target thread and the stack of its wait (waits.c decides which).  Pasted
 * into pyoffcpu.bpf.c by the loader. */

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
    if (SYSTEM_WIDE)
        return (prev_tid && prev_tgid != ctl->self_tgid ? SW_PREV : 0) |
               (next_tgid && next_tgid != ctl->self_tgid ? SW_NEXT : 0);
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
    /* next's tgid from its task_struct (offsets from BTF): a load where the
     * kernel lets us cast (task_u32), else a helper call that reads its pid
     * too where they are side by side, as in every kernel */
    u32 next_tgid = 0, next_tid = 0;
    /* (the offsets are constants to the verifier: one branch is left) */
    int side_by_side = TASK_TGID_OFF == TASK_PID_OFF + 4;
    if (KERNEL_CAST) {
        next_tgid = task_u32(ctx->args[2], TASK_TGID_OFF);
    } else if (side_by_side) {
        u32 pt[2] = {};
        bpf_probe_read_kernel(pt, sizeof(pt), (void *)(ctx->args[2] + TASK_PID_OFF));
        next_tid = pt[0];
        next_tgid = pt[1];
    } else {
        bpf_probe_read_kernel(&next_tgid, sizeof(next_tgid), (void *)(ctx->args[2] + TASK_TGID_OFF));
    }
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
        if (KERNEL_CAST || !side_by_side)
            next_tid = task_u32(next, TASK_PID_OFF);
        if (next_tid)
            switch_in(ctx, ctl, next_tid, now, next);
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
    u64 exec = task_u64(ctx->args[1], TASK_EXEC_OFF);
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
            u64 began = open_st->ts;
            offcpu_start.delete(&prev);
            if (kept) {
                add_time(&okey, span - on);
                th->off_ns += span - on;
                /* it ended when the thread ran again, `on` before now (the
                 * flame graph has it: so has the timeline) */
                if (TIMELINE && now - on >= began + ctl->timeline_min_ns)
                    timeline_send(ctx, &okey, began, now - on, th->comm);
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
        th->flags = (th->flags & ~TH_OFF) | TH_EXITED;
        th->last_ts = now;
        switch_memo.delete(&prev);
        if (th->flags & TH_HELD)
            fold_progs.call(ctx, 0);    /* fold_exit: it adds the short totals */
        short_flush(th, prev);          /* not held, or the tail call failed */
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
        th->wait_kstack = KERNEL_STACKS ? kstacks.get_stackid(ctx, 0) : -1;
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
    /* the tail call failed: us begins with an offcpu_start (key, ts), not
     * copied to the stack, whose 512 bytes the inlined walks use up */
    _Static_assert(__builtin_offsetof(struct unwind_state, ts) == __builtin_offsetof(struct offcpu_start, ts) &&
                   __builtin_offsetof(struct unwind_state, key) == 0, "unwind_state starts as offcpu_start");
    if (offcpu_start.update(&prev, (struct offcpu_start *)us) != 0)
        count_drop(DROP_START_FULL);
    return 0;
}
