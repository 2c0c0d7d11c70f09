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
 * Set by the loader at load time (bpf/loadconst.h), or with -D:
 *   TASK_FSBASE_OFF       offsetof(task_struct, thread.fsbase), from BTF
 *   TASK_PID_OFF, TASK_TGID_OFF   offsetof(task_struct, pid / tgid), from BTF
 *   TASK_EXEC_OFF         offsetof(task_struct, se.sum_exec_runtime), from BTF
 *   SAMPLE_PERIOD_NS      on-CPU sampling period
 *   KERNEL_STACKS         1 to capture kernel stacks
 *   SYSTEM_WIDE           1 to take every process, not only those in `procs`
 *   WAKERS, ASYNC_TASKS, TIMELINE   1 with --wakers, --async, --timeline
 *   EXIT_GROUP_DEAD       1 if sched_process_exit passes group_dead (BTF)
 *   SYS_REGS_AX_OFF, SYS_REGS_ORIG_AX_OFF, SYS_REGS_CS_OFF   pt_regs offsets (BTF), for
 *                         the system call a thread blocks in (orig_ax past 128 bytes: none)
 *   NATIVE_UNWIND         1 to walk user stacks with .eh_frame tables (bpf/unwind.c;
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
/* A tgid that ends user space's wait at once: under -a, a process's first
 * sample without a registration (its entry in `unregistered` made), taken
 * then instead of at the next look at `unregistered`; else a target's exec,
 * whose new image is read then instead of at the loop's next turn. */
BPF_PERF_OUTPUT(loop_wakes);
BPF_STACK_TRACE(ustacks, 32768);
BPF_STACK_TRACE(kstacks, 16384);
BPF_PERCPU_ARRAY(scratch, struct pystack, 3);   /* 0: on-CPU program, 1: sched_switch, 2: sched_waking */
BPF_PERCPU_ARRAY(drops, u64, N_DROPS);
BPF_PERCPU_ARRAY(drops_ns, u64, N_DROPS);
BPF_PERF_OUTPUT(pystack_events);
/* --wakers (made with 1 entry without it) */
BPF_HASH(last_waker, u32, struct waker_t, 65536);       /* wakee tid -> its last waker */
BPF_HASH(wake_agg, struct wake_key, struct stack_value, 65536);
/* Per CPU: how deep in interrupt handlers (0), and in timer expiries (1). */
BPF_PERCPU_ARRAY(irq_depth, u32, 2);
BPF_PERF_OUTPUT(timeline);          /* struct timeline_event: --timeline */
/* Waits left out by --min-block-us / --max-block-us: 0 how many, 1 their ns. */
BPF_PERCPU_ARRAY(block_filtered, u64, 2);
/* The kernel's fold of ended threads (pyoffcpu.h, fold_exit). */
/* preallocated (an insert at every thread's birth; 7.3 MiB): more live
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
 * loader, as unwind.c below. */
#include "pywalk.c" /* inline */

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
 * none.  pt_regs offsets from BTF (PT_REGS_*_OFF, loadconst.h). */
static __always_inline int current_user_regs(u64 *pc, u64 *sp, u64 *bp, u64 *bx)
{
    if (!NATIVE_UNWIND)
        return 0;
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
}

/* --timeline: one wait (end: its switch-in) or on-CPU sample (end 0) of the
 * thread named comm, with its stack key, to user space.  A wait's waker is
 * the thread that woke it after it began (--wakers).  A full buffer loses
 * the event (user space counts what perf reports lost). */
static __always_inline void timeline_send(void *ctx, struct stack_key *key, u64 begin, u64 end,
                                          char *comm)
{
    struct timeline_event ev = {};
    __builtin_memcpy(&ev.key, key, sizeof(ev.key));
    ev.begin = begin;
    ev.end = end;
    __builtin_memcpy(ev.comm, comm, sizeof(ev.comm));
    struct waker_t *w = WAKERS && end ? last_waker.lookup(&key->tid) : 0;
    if (w && w->ts >= begin && w->kind == WAKER_TASK) {
        ev.wake_ts = w->ts;
        ev.waker_tgid = w->tgid;
        ev.waker_tid = w->tid;
    }
    timeline.perf_submit(ctx, &ev, sizeof(ev));
}

/* Inlined by the loader (session._bpf_source): bcc rewrites map calls such
 * as table.lookup() only in the main file. */
#include "unwind.c" /* inline */
#include "memo.c" /* inline */
#include "oncpu.c" /* inline */
#include "waits.c" /* inline */
#include "switch.c" /* inline */
#include "fold.c" /* inline */
#include "life.c" /* inline */
#include "wakers.c" /* inline */
