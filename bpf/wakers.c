/* pyoffcpu.bpf.c's part: --wakers (sched_waking, and the interrupt
 * context it is told apart from).  Pasted into pyoffcpu.bpf.c by the loader. */

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
    u32 wtgid = task_u32(p, TASK_TGID_OFF);
    if (!wtgid || !is_target(ctl, wtgid))
        return 0;
    u32 wtid = task_u32(p, TASK_PID_OFF);
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
            if (KERNEL_STACKS)
                key->kstack = kstacks.get_stackid(ctx, 0);
        }
    }
    wake_recorded(us);
    return 0;
}
