/* pyoffcpu's BPF side, compiled by bcc at load time.
 *
 * on_cpu_sample (perf_event cpu-clock) and sched_switch (tracepoint) both
 * capture one stack_key per event: kernel and user stack ids, and the hash of
 * the Python stack walked here.  Times are aggregated in `agg`; the loader
 * drains it.  New Python stacks go to user space once, through pystack_events,
 * so their code objects are resolved while the target is alive.
 *
 * Set by the loader with -D:
 *   TASK_FSBASE_OFF       offsetof(task_struct, thread.fsbase), from BTF
 *   PTHREAD_SPECIFIC_OFF  offsetof(struct pthread, specific_1stblock), glibc x86_64
 *   SAMPLE_PERIOD_NS      on-CPU sampling period
 *   KERNEL_STACKS         1 to capture kernel stacks
 *   SYSTEM_WIDE           1 to take every process, not only those in `procs`
 *   NATIVE_UNWIND         1 to walk user stacks with .eh_frame tables (bpf/unwind.h;
 *                         0: frame pointers, through the same finishing programs)
 * Kernel structs are never dereferenced by type: the headers bcc compiles
 * against are not the running kernel's.
 */
#include <uapi/linux/ptrace.h>
#include <uapi/linux/bpf_perf_event.h>
#include "pyoffcpu.h"

#define PY_MASK (MAX_PY_DEPTH - 1)

BPF_HASH(procs, u32, struct proc_info, 4096);
BPF_HASH(agg, struct stack_key, struct stack_value, 65536);
BPF_HASH(offcpu_start, u32, struct offcpu_start, 65536);
BPF_HASH(pystack_seen, u64, u8, 131072);
/* Threads of the targets that existed when the recording started (filled by
 * user space, value 0) -> the time of their first switch-in, when they were
 * blocked since before the start, or 1 when their first switch was a
 * switch-out (they were running).  User space accounts the blocked part. */
BPF_HASH(preexisting, u32, u64, 65536);
BPF_HASH(thread_names, u32, struct comm_t, 65536);
BPF_STACK_TRACE(ustacks, 32768);
BPF_STACK_TRACE(kstacks, 16384);
BPF_PERCPU_ARRAY(scratch, struct pystack, 2);   /* 0: on-CPU program, 1: sched_switch */
BPF_PERCPU_ARRAY(drops, u64, N_DROPS);
BPF_PERF_OUTPUT(pystack_events);

static __always_inline void count_drop(int idx)
{
    u64 *v = drops.lookup(&idx);
    if (v)
        (*v)++;
}

static __always_inline u64 read_u64(u64 addr, int *failed)
{
    u64 v = 0;
    if (bpf_probe_read_user(&v, sizeof(v), (void *)addr) != 0)
        *failed = 1;
    return v;
}

/* The current thread's PyThreadState, as pthread_getspecific(autoTSSkey)
 * would return it: the gilstate binding survives while a thread blocks with
 * the GIL released (3.12+ clear _Py_tss_tstate then; see reference §7). */
static __always_inline u64 current_tstate(struct proc_info *pi)
{
    int key = pi->tss_key;
    if (key < 0 || key >= 32)       /* only glibc's first block of keys */
        return 0;
    u64 task = bpf_get_current_task();
    u64 fsbase = 0;
    bpf_probe_read_kernel(&fsbase, sizeof(fsbase), (void *)(task + TASK_FSBASE_OFF));
    if (!fsbase)
        return 0;
    int failed = 0;
    /* struct pthread_key_data { uintptr_t seq; void *data; } specific_1stblock[32] */
    return read_u64(fsbase + PTHREAD_SPECIFIC_OFF + key * 16 + 8, &failed);
}

static __always_inline u64 first_frame(struct proc_info *pi, u64 tstate, int *failed)
{
    if (pi->walker == WALK_FRAMEOBJ)
        return read_u64(tstate + pi->tstate_frame, failed);
    if (pi->tstate_cframe >= 0) {
        u64 cframe = read_u64(tstate + pi->tstate_cframe, failed);
        if (!cframe)
            return 0;
        return read_u64(cframe + pi->cframe_current_frame, failed);
    }
    return read_u64(tstate + pi->tstate_current_frame, failed);
}

static __always_inline u64 mix(u64 h, u64 v)
{
    h ^= v;
    h *= 0x100000001b3ULL;          /* FNV-1a style multiply, per 64-bit word */
    return h ^ (h >> 29);
}

/* The verifier walks a bounded loop once per iteration, so the loop bodies
 * below are kept straight: one loop per frame layout, a failed read ends the
 * walk, and shim frames are recorded like any other (user space drops them by
 * their owner) so that the frame count never diverges from the iteration count. */

/* The fields of a frame the walk needs all lie in its first bytes (3.11
 * _PyInterpreterFrame: owner at 69, 3.12/3.13: 70, 3.14: 74; <= 3.10
 * PyFrameObject: f_lasti at 104 at most): one read per frame into a per-CPU
 * window instead of three to five reads, the bulk of the walk's run time.
 * Offsets are masked into the window (136 bytes; only the first ones read). */
#define IFRAME_WINDOW 80
#define FRAMEOBJ_WINDOW 112
#define FRAME_OFF(off) ((u64)(off) & 127)
struct frame_win { u8 b[136]; };
/* One per CPU is enough: BPF tracing programs do not nest on a CPU. */
BPF_PERCPU_ARRAY(frame_win, struct frame_win, 1);

/* <= 3.10: PyFrameObject chain; each frame is one _PyEval_EvalFrameDefault call. */
static __always_inline u32 walk_frameobj(struct proc_info *pi, struct pystack *st, u64 f)
{
    int i;
    u64 off_code = FRAME_OFF(pi->frame_code), off_back = FRAME_OFF(pi->frame_back);
    u64 off_lasti = FRAME_OFF(pi->frame_lasti);
    int zero = 0;
    struct frame_win *win = frame_win.lookup(&zero);
    if (!win)
        return 0;
    u8 *w = win->b;
    for (i = 0; i < MAX_PY_DEPTH; i++) {
        if (!f)
            break;
        if (bpf_probe_read_user(w, FRAMEOBJ_WINDOW, (void *)f) != 0) {
            st->flags |= PYS_READ_FAILED;
            break;
        }
        u64 code = *(u64 *)(w + off_code);
        u64 back = *(u64 *)(w + off_back);
        int lasti = *(int *)(w + off_lasti);
        struct py_frame *pf = &st->frames[i & PY_MASK];
        pf->code = code;
        pf->offset = lasti;
        pf->flags = PYF_ENTRY;
        f = back;
    }
    if (f && i >= MAX_PY_DEPTH)
        st->flags |= PYS_TRUNCATED;
    return i;
}

/* 3.11+: _PyInterpreterFrame chain. */
static __always_inline u32 walk_iframes(struct proc_info *pi, struct pystack *st, u64 f)
{
    int i;
    u64 off_code = FRAME_OFF(pi->iframe_code), off_prev = FRAME_OFF(pi->iframe_previous);
    u64 off_instr = FRAME_OFF(pi->iframe_instr), off_owner = FRAME_OFF(pi->iframe_owner);
    /* 3.12+ have no is_entry: read the owner byte twice, and ignore it */
    u64 off_entry = FRAME_OFF(pi->iframe_is_entry >= 0 ? pi->iframe_is_entry : pi->iframe_owner);
    u32 entry_flag = pi->walker == WALK_ISENTRY ? PYF_ENTRY : 0;
    s64 adaptive = pi->code_code_adaptive;
    int zero = 0;
    struct frame_win *win = frame_win.lookup(&zero);
    if (!win)
        return 0;
    u8 *w = win->b;
    for (i = 0; i < MAX_PY_DEPTH; i++) {
        if (!f)
            break;
        if (bpf_probe_read_user(w, IFRAME_WINDOW, (void *)f) != 0) {
            st->flags |= PYS_READ_FAILED;
            break;
        }
        u64 code = *(u64 *)(w + off_code);
        u64 instr = *(u64 *)(w + off_instr);
        u64 prev = *(u64 *)(w + off_prev);
        u8 owner = w[off_owner];
        u8 is_entry = w[off_entry];
        code &= ~3ULL;              /* 3.14 tags f_executable; code objects are 8-aligned */
        struct py_frame *pf = &st->frames[i & PY_MASK];
        pf->code = code;
        pf->offset = (int)(instr - code - adaptive);
        pf->flags = owner | (((u32)(is_entry & 1) << 8) & entry_flag);
        f = prev;
    }
    if (f && i >= MAX_PY_DEPTH)
        st->flags |= PYS_TRUNCATED;
    return i;
}

/* Walk the Python frames of the current thread into st; returns the stack's
 * hash (0: no Python frames). */
static __always_inline u64 walk_python(struct proc_info *pi, struct pystack *st, u32 tgid)
{
    st->depth = 0;
    st->flags = 0;
    st->tgid = tgid;
    if (pi->walker == WALK_NONE)
        return 0;
    u64 tstate = current_tstate(pi);
    if (!tstate)
        return 0;
    int failed = 0;
    u64 f = first_frame(pi, tstate, &failed);
    if (failed) {
        count_drop(DROP_PY_READ);
        return 0;
    }
    u32 n = pi->walker == WALK_FRAMEOBJ ? walk_frameobj(pi, st, f) : walk_iframes(pi, st, f);
    if (st->flags & PYS_READ_FAILED)
        count_drop(DROP_PY_READ);
    if (st->flags & PYS_TRUNCATED)
        count_drop(DROP_PY_TRUNCATED);
    st->depth = n;
    if (n == 0)
        return 0;
    u64 h = 0xcbf29ce484222325ULL ^ tgid;
    for (int j = 0; j < MAX_PY_DEPTH; j++) {
        if (j >= n)
            break;
        struct py_frame *pf = &st->frames[j & PY_MASK];
        h = mix(h, pf->code);
        h = mix(h, ((u64)pf->flags << 32) | (u32)pf->offset);
    }
    h = mix(h, st->flags);
    if (h == 0)
        h = 1;
    st->hash = h;
    return h;
}

/* Switch memo.  A thread that blocks again exactly where it blocked last time
 * (same user PC and stack pointer, same innermost Python frame and
 * instruction) has the same stacks: ping-pong threads switch tens of
 * thousands of times a second from one place, and a full capture (Python
 * walk + native unwind) costs ~9 us each.  The memo keeps the last key per
 * thread; only with NATIVE_UNWIND, whose pt_regs offsets the signature needs.
 * Kernel stacks are still taken fresh. */
struct switch_sig {
    u64 pc, sp, frame, instr;
};
struct switch_memo_t {
    struct switch_sig sig;
    struct stack_key key;
};
BPF_HASH(switch_memo, u32, struct switch_memo_t, 65536);
/* The signature of the switch being captured, for unwind_tp to memorise. */
struct switch_pending_t {
    struct switch_sig sig;
    u32 ok;
};
BPF_PERCPU_ARRAY(switch_pending, struct switch_pending_t, 1);

/* The current thread's user registers, as saved at kernel entry (right for
 * a sample taken in kernel mode and at sched_switch alike); 0 when it has
 * none.  pt_regs offsets from BTF (-DPT_REGS_*_OFF, with NATIVE_UNWIND). */
static __always_inline int current_user_regs(u64 *pc, u64 *sp, u64 *bp)
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
    err |= bpf_probe_read_kernel(&cs, 8, (void *)(regs + PT_REGS_CS_OFF));
    return err == 0 && (cs & 3) == 3;
#else
    return 0;
#endif
}

static __always_inline int switch_signature(u32 tgid, struct switch_sig *sig)
{
#if NATIVE_UNWIND
    u64 bp;
    if (!current_user_regs(&sig->pc, &sig->sp, &bp))
        return 0;
    struct proc_info *pi = procs.lookup(&tgid);
    if (pi && pi->walker != WALK_NONE) {
        u64 tstate = current_tstate(pi);
        if (tstate) {
            int failed = 0;
            u64 f = first_frame(pi, tstate, &failed);
            if (failed)
                return 0;
            sig->frame = f;
            u64 off = pi->walker == WALK_FRAMEOBJ ? pi->frame_lasti : pi->iframe_instr;
            if (f && bpf_probe_read_user(&sig->instr, 8, (void *)(f + off)) != 0)
                return 0;
        }
    }
    return 1;
#else
    return 0;
#endif
}

static __always_inline int same_sig(struct switch_sig *a, struct switch_sig *b)
{
    return a->pc == b->pc && a->sp == b->sp && a->frame == b->frame && a->instr == b->instr;
}

/* Inlined by the loader (session._bpf_source): bcc rewrites map calls such
 * as table.lookup() only in the main file. */
#include "unwind.h" /* inline */

/* Fill key for the current thread; sends a Python stack seen for the first time. */
static __always_inline void capture(void *ctx, struct stack_key *key, u32 tgid, u32 tid, int slot)
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
#if KERNEL_STACKS
    key->kstack = kstacks.get_stackid(ctx, 0);
    if (key->kstack < 0 && key->kstack != -14)  /* -EFAULT: sampled in user mode */
        count_drop(DROP_KSTACK);
#else
    key->kstack = -1;
#endif
    key->pystack = 0;
    struct proc_info *pi = procs.lookup(&tgid);
    if (!pi)
        return;
    struct pystack *st = scratch.lookup(&slot);
    if (!st)
        return;
    u64 h = walk_python(pi, st, tgid);
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

static __always_inline int is_target(u32 tgid)
{
#if SYSTEM_WIDE
    return 1;
#else
    return procs.lookup(&tgid) != 0;
#endif
}

static __always_inline void add_time(struct stack_key *key, u64 ns)
{
    struct stack_value zero = {};
    struct stack_value *v = agg.lookup_or_try_init(key, &zero);
    if (!v) {
        count_drop(DROP_AGG_FULL);
        return;
    }
    __sync_fetch_and_add(&v->count, 1);
    __sync_fetch_and_add(&v->ns, ns);
}

int on_cpu_sample(struct bpf_perf_event_data *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    if (tid == 0 || !is_target(tgid))
        return 0;
    if (!thread_names.lookup(&tid)) {
        struct comm_t name = {};
        bpf_get_current_comm(&name.c, sizeof(name.c));
        thread_names.insert(&tid, &name);
    }
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
    capture(ctx, key, tgid, tid, 0);
    unwind_perf_progs.call(ctx, 0);
    add_time(key, SAMPLE_PERIOD_NS);    /* the tail call failed */
    return 0;
}

static __always_inline u32 off_cpu_kind(long state)
{
    /* sched_switch reports a preempted task as TASK_REPORT_MAX (0x100) */
    if (state & 0x100)
        return KIND_RUNQUEUE;
    switch (state & 0xff) {
    case 0: return KIND_RUNQUEUE;
    case 1: return KIND_SLEEP;
    case 2: return KIND_UNINTERRUPTIBLE;
    case 0x80: return KIND_SLEEP;   /* TASK_IDLE */
    default: return KIND_OTHER;
    }
}

TRACEPOINT_PROBE(sched, sched_switch)
{
    u64 now = bpf_ktime_get_ns();
    u32 next = args->next_pid;

    /* Switch-in: close the interval the thread has been off the CPU. */
    if (next != 0) {
        struct offcpu_start *st = offcpu_start.lookup(&next);
        if (st) {
            struct stack_key key = st->key;
            u64 ns = now - st->ts;
            offcpu_start.delete(&next);
            add_time(&key, ns);
        } else {
            u64 *first = preexisting.lookup(&next);
            if (first && *first == 0)
                *first = now;
        }
    }

    /* Switch-out: prev is still current, so its stacks are ours to take. */
    u32 prev = args->prev_pid;
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (prev == 0 || (u32)id != prev || !is_target(tgid))
        return 0;
    u64 *first = preexisting.lookup(&prev);
    if (first && *first == 0)
        *first = 1;
    if (args->prev_state & 0x30)    /* X or Z: the thread is exiting, it will not come back */
        return 0;
    struct comm_t name = {};
    bpf_probe_read_kernel(&name.c, sizeof(name.c), args->prev_comm);
    thread_names.update(&prev, &name);
    int zero = 0;
    struct switch_pending_t *pending = switch_pending.lookup(&zero);
    if (!pending)
        return 0;
    /* Only voluntary switches: a preempted thread stops anywhere, mid-call
     * included, and would rarely hit anyway. */
    u32 kind = off_cpu_kind(args->prev_state);
    pending->ok = kind != KIND_RUNQUEUE && switch_signature(tgid, &pending->sig);
    if (pending->ok) {
        struct switch_memo_t *memo = switch_memo.lookup(&prev);
        if (memo && same_sig(&memo->sig, &pending->sig)) {
            struct offcpu_start hit = {};
            hit.key = memo->key;
            hit.key.kind = kind;
#if KERNEL_STACKS
            hit.key.kstack = kstacks.get_stackid(args, 0);
#endif
            hit.ts = now;
            if (offcpu_start.update(&prev, &hit) != 0)
                count_drop(DROP_START_FULL);
            return 0;
        }
    }
    /* As in on_cpu_sample: unwind_tp records the interval start. */
    int slot = 1;
    struct unwind_state *us = unwind_scratch.lookup(&slot);
    if (!us)
        return 0;
    struct stack_key *key = &us->key;
    __builtin_memset(key, 0, sizeof(*key));
    key->kind = off_cpu_kind(args->prev_state);
    us->ts = now;
    capture(args, key, tgid, prev, 1);
    unwind_tp_progs.call(args, 0);
    struct offcpu_start st = {};        /* the tail call failed */
    st.key = *key;
    st.ts = now;
    if (offcpu_start.update(&prev, &st) != 0)
        count_drop(DROP_START_FULL);
    return 0;
}
