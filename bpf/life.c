/* pyoffcpu.bpf.c's part: the life of the targets' processes and threads
 * (sched_process_fork, _exec, _exit, and the life log user space reads).
 * Pasted into pyoffcpu.bpf.c by the loader. */

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
    /* (the start is written ahead of its instant: one born before it was
     * there at the start) */
    int born = ctl->start_ns && bpf_ktime_get_ns() >= ctl->start_ns;
    fresh.flags = born ? TH_BORN : 0;
    if (born && ctl->fold) {
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
    u32 ctgid = task_u32(child, TASK_TGID_OFF), ctid = task_u32(child, TASK_PID_OFF);
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
        /* user space reads the new image at once (-a: one it registered;
         * the others are met at their first sample) */
        if (!SYSTEM_WIDE || pi)
            loop_wakes.perf_submit(ctx, &tgid, sizeof(tgid));
    } else if (!ctl->discover) {
        return 0;
    }
    new_image(tgid);
    return 0;
}

/* Every thread's exit, in its own context before its last switch: a target
 * thread's entry gets the time (TH_EXITING).  In cpu mode nothing else tells
 * that a thread ended (no switch is seen): without it, ended threads stayed
 * in the map until it was full.  In wall mode it bounds a thread whose last
 * switch-out BPF does not see, which was accounted until the end.
 * A registered process's last thread exits: user space retires it now
 * (its tables go, its PID may be another's next).  Where the tracepoint has
 * no group_dead (older kernels), the group leader's exit stands in and
 * user space's liveness checks catch the rest. */
RAW_TRACEPOINT_PROBE(sched_process_exit)
{
    int zero = 0;
    struct control_t *ctl = control.lookup(&zero);
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    if (ctl && is_target(ctl, tgid)) {
        struct thread_t *th = threads.lookup(&tid);
        u64 now = bpf_ktime_get_ns();
        if (th && !(th->flags & TH_EXITED)) {
            if (!ctl->start_ns || now < ctl->start_ns) {
                /* ended before the start: none of it is in the recording
                 * (were its entry kept, a thread that is gone would be
                 * there all along; its last switch-out, should it come
                 * after the start, makes one again for its last us) */
                threads.delete(&tid);
            } else if (recording_at(ctl, now)) {
                th->exit_ts = now;
                th->flags |= TH_EXITING;
            }
        }
    }
    if (!last_thread_exits(ctx))
        return 0;
    if (!procs.lookup(&tgid))
        return 0;
    unwind_procs.delete(&tgid);
    log_life(LIFE_EXIT, tgid, 0);
    if (!SYSTEM_WIDE)               /* user space's loop reads the log now */
        loop_wakes.perf_submit(ctx, &tgid, sizeof(tgid));
    return 0;
}
