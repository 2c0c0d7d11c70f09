/* pyoffcpu's crash watcher (`pyoffcpu crashes`), compiled by bcc at load
 * time, apart from the profiler's programs: it stays attached for days, so
 * it holds only what one capture needs.
 *
 * crash_signal runs at every signal delivery (raw tracepoint
 * signal_deliver, in the context of the thread that receives it, before the
 * kernel acts on it: a fatal signal's process is gone microseconds later).
 * For SIGSEGV, SIGBUS, SIGABRT, SIGFPE and SIGILL of a watched process it
 * sends what user space needs to show the thread's stacks afterwards (see
 * crashes.h for the records): the registers as saved at kernel entry, the
 * user stack's bytes, the kernel stack, and for a registered Python process
 * its Python frames (walked by pywalk.c, as the profiler walks them; tail
 * call crash_py) and the code objects they name with the strings and line
 * tables CodeReader reads (crash_code, which tail-calls itself); then the
 * same for each other thread of its interpreter (crash_other, one tail
 * call per thread, as long as the kernel's limit of 33 tail calls lasts).
 *
 * A registration is for one process image: an exec ends it (the layouts,
 * the thread-state binding are the old program's) and so does the process's
 * end (its PID may be reused), here at once, before user space's next scan
 * has seen either; each crash carries the process's start and exec count,
 * which user space matches against what it registered.
 *
 * Set by the loader at load time (loadconst.h):
 *   TASK_FSBASE_OFF   offsetof(task_struct, thread.fsbase), from BTF
 *   TASK_LEADER_OFF, TASK_START_OFF   offsetof(task_struct, group_leader) and
 *                     (start_boottime), from BTF
 *   EXIT_GROUP_DEAD   sched_process_exit says when a process's last thread exits
 *   PT_REGS_SIZE      sizeof(struct pt_regs), from BTF
 * and bigbuf's size, the possible CPUs.
 * Kernel structs are never dereferenced by type (see pyoffcpu.bpf.c).
 */
#include <uapi/linux/ptrace.h>
#define ASYNC_TASKS 0               /* pywalk.c: no task frame kept */
#include "pyoffcpu.h"
#include "crashes.h"

/* signals that end a process by default with a core: the crashes */
#define CRASH_SIGNALS ((1u << 4) | (1u << 6) | (1u << 7) | (1u << 8) | (1u << 11))  /* ILL ABRT BUS FPE SEGV */

BPF_ARRAY(control, struct crash_control, 1);
/* The watcher stays on for days with few entries in these: not
 * preallocated (the kernel would reserve every entry's memory up front). */
/* control.only_watched: the tgids */
BPF_F_TABLE("hash", u32, u8, watched, 4096, BPF_F_NO_PREALLOC);
/* Registered Python processes (filled as the profiler fills its own) and
 * where their code objects' fields lie. */
BPF_F_TABLE("hash", u32, struct proc_info, procs, 4096, BPF_F_NO_PREALLOC);
BPF_F_TABLE("hash", u32, struct crash_layout, layouts, 4096, BPF_F_NO_PREALLOC);
BPF_PERF_OUTPUT(events);
BPF_PERF_OUTPUT(births);                        /* struct crash_birth */
BPF_TABLE("lru_hash", struct exe_id, u8, exe_kinds, 4096);   /* CR_EXE_* by program file */
BPF_PROG_ARRAY(progs, 3);                       /* 0: crash_py, 1: crash_code, 2: crash_other */
BPF_PERCPU_ARRAY(state, struct crash_state, 1);
BPF_PERCPU_ARRAY(mainbuf, struct crash_main, 1);
BPF_PERCPU_ARRAY(pybuf, struct crash_py, 1);
/* The stack's and the objects' copies: larger than a per-CPU value may be
 * (32 KiB), so a plain array with an entry per CPU: declared with one,
 * made with one per possible CPU by the loader (CrashCapture's sizes). */
BPF_ARRAY(bigbuf, struct crash_stack, 1);
/* execs per process since the watcher started (LRU: a process that ends
 * takes its entry with it, below; the bound is a guard) */
BPF_TABLE("lru_hash", u32, u64, execs, 16384);
/* the objects copied in the last captures (crash_seen), for their dedup */
BPF_TABLE("lru_hash", struct crash_seen, u8, seen, 1024);
/* what became of the crash signals (crashes.h CRT_*), and each user's
 * budget (LRU: a bound however many users crash) */
BPF_PERCPU_ARRAY(tally, u64, CRT_N);
BPF_TABLE("lru_hash", u32, struct uid_budget, budgets, 1024);
/* walk_python's counters (pyoffcpu.h DROP_*), as the profiler's */
BPF_PERCPU_ARRAY(drops, u64, N_DROPS);

static __always_inline void count_drop(int idx)
{
    u64 *v = drops.lookup(&idx);
    if (v)
        (*v)++;
}

/* current_tstate, walk_python: the profiler's own (inlined by the loader) */
#include "pywalk.c" /* inline */

static __always_inline void tally_add(int idx)
{
    u64 *v = tally.lookup(&idx);
    if (v)
        (*v)++;
}

/* A record after CR_MAIN; one that does not fit in the buffer marks the
 * capture (CRF_PART_LOST), which user space then gives as incomplete. */
static __always_inline void submit(void *ctx, struct crash_state *s, void *data, u64 size)
{
    if (events.perf_submit(ctx, data, size) != 0)
        s->flags |= CRF_PART_LOST;
}

/* The user's budget for this second (crashes.h): 0 capture in full, 1
 * without the stack's copy, -1 not at all (counted). */
static __always_inline int budget(u32 uid, u64 now)
{
    struct uid_budget *b = budgets.lookup(&uid);
    if (!b) {
        struct uid_budget fresh = {};
        fresh.window = now;
        budgets.update(&uid, &fresh);
        b = budgets.lookup(&uid);
        if (!b)
            return 0;               /* no entry: capture, as before budgets */
    }
    if (now - b->window >= 1000000000ULL) {
        b->window = now;
        b->full = 0;
        b->all = 0;
    }
    if (b->all >= CR_PER_UID_S) {
        __sync_fetch_and_add(&b->rate, 1);
        tally_add(CRT_RATE);
        return -1;
    }
    __sync_fetch_and_add(&b->all, 1);
    if (b->full >= CR_FULL_PER_UID_S) {
        tally_add(CRT_LIGHT);
        return 1;
    }
    __sync_fetch_and_add(&b->full, 1);
    return 0;
}

static __always_inline void fill_hdr(struct crash_hdr *h, struct crash_state *s, u32 kind, u32 len)
{
    h->id = s->id;
    h->kind = kind;
    h->tgid = s->tgid;
    h->tid = s->tid;
    h->len = len;
}

static __always_inline void send_end(void *ctx, struct crash_state *s)
{
    struct crash_end e = {};
    fill_hdr(&e.h, s, CR_END, 0);
    e.flags = s->flags;
    e.objects = s->objects;
    submit(ctx, s, &e, sizeof(e));
}

/* The user stack from sp up, page by page: a read that crosses into an
 * unmapped page fails whole, so each page is its own read and the copy
 * keeps what lies below the end of the stack's mapping. */
static __always_inline void send_stack(void *ctx, struct crash_state *s, u64 sp)
{
    u32 cpu = bpf_get_smp_processor_id();
    struct crash_stack *b = bigbuf.lookup(&cpu);
    if (!b)
        return;
    u32 off = 0;
    for (int i = 0; i < CR_STACK_PAGES; i++) {
        u64 n = 4096 - ((sp + off) & 4095);
        if (n > CR_STACK_MAX - off)
            n = CR_STACK_MAX - off;
        if (n == 0 || n > 4096)
            break;
        if (bpf_probe_read_user(b->data + (off & (CR_STACK_MAX - 1)), n, (void *)(sp + off)) != 0)
            break;
        off += n;
        if (off >= CR_STACK_MAX)
            break;
    }
    if (off < CR_STACK_MAX)
        s->flags |= CRF_STACK_SHORT;
    fill_hdr(&b->h, s, CR_STACK, off);
    b->sp = sp;
    u64 size = off;
    if (size > CR_STACK_MAX)
        size = CR_STACK_MAX;
    submit(ctx, s, b, offsetof(struct crash_stack, data) + size);
}

int crash_signal(struct bpf_raw_tracepoint_args *ctx)
{
    /* signal_deliver(int sig, struct kernel_siginfo *info, struct k_sigaction *ka) */
    u32 sig = (u32)ctx->args[0];
    if (sig >= 32 || !((1u << sig) & CRASH_SIGNALS))
        return 0;
    int zero = 0;
    struct crash_control *ctl = control.lookup(&zero);
    if (!ctl)
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    u32 uid = (u32)bpf_get_current_uid_gid();
    if (ctl->uid != CR_ANY_UID && uid != ctl->uid)
        return 0;
    if (ctl->only_watched && !watched.lookup(&tgid))
        return 0;

    struct crash_state *s = state.lookup(&zero);
    struct crash_main *m = mainbuf.lookup(&zero);
    if (!s || !m)
        return 0;
    u64 now = bpf_ktime_get_ns();
    tally_add(CRT_SEEN);
    int light = budget(uid, now);
    if (light < 0)
        return 0;
    s->id = now;
    s->tgid = tgid;
    s->tid = (u32)id;
    s->flags = 0;
    s->objects = 0;
    s->frame = 0;
    s->obj = 0;

    fill_hdr(&m->h, s, CR_MAIN, 0);
    m->sig = sig;
    m->si_code = 0;
    m->addr = 0;
    m->handler = 0;
    u64 info = ctx->args[1];
    /* struct kernel_siginfo: si_signo, si_errno, si_code (ints), then the
     * union, whose first word is si_addr for the faults */
    bpf_probe_read_kernel(&m->si_code, sizeof(m->si_code), (void *)(info + 8));
    bpf_probe_read_kernel(&m->addr, sizeof(m->addr), (void *)(info + 16));
    bpf_probe_read_kernel(&m->handler, sizeof(m->handler), (void *)ctx->args[2]);
    m->uid = uid;
    bpf_get_current_comm(m->comm, sizeof(m->comm));
    u64 task = bpf_get_current_task();
    m->fsbase = 0;
    bpf_probe_read_kernel(&m->fsbase, sizeof(m->fsbase), (void *)(task + TASK_FSBASE_OFF));
    u64 leader = 0;
    m->start_ns = 0;
    bpf_probe_read_kernel(&leader, sizeof(leader), (void *)(task + TASK_LEADER_OFF));
    if (leader)
        bpf_probe_read_kernel(&m->start_ns, sizeof(m->start_ns), (void *)(leader + TASK_START_OFF));
    u64 *n = execs.lookup(&tgid);
    m->execs = n ? (u32)*n : 0;

    /* the user registers as saved at kernel entry: the fault's, or those
     * of the system call that raised the signal (abort's tgkill) */
    u64 regs = bpf_task_pt_regs(bpf_get_current_task_btf());
    u64 sp = 0;
    m->regs_len = 0;
    u64 regs_size = PT_REGS_SIZE;   /* the loader checks it fits */
    if (regs_size > CR_REGS_MAX)
        regs_size = CR_REGS_MAX;
    if (regs && bpf_probe_read_kernel(m->regs, regs_size, (void *)regs) == 0) {
        m->regs_len = regs_size;
        sp = *(u64 *)(m->regs + (PT_REGS_SP_OFF & (CR_REGS_MAX - 8)));
        u64 cs = *(u64 *)(m->regs + (PT_REGS_CS_OFF & (CR_REGS_MAX - 8)));
        if ((cs & 3) != 3)
            sp = 0;                 /* a kernel thread's: no user stack */
    }
    if (!sp)
        s->flags |= CRF_NO_REGS;
    if (light)
        s->flags |= CRF_LIGHT;
    m->kstack_len = bpf_get_stack(ctx, m->kstack, sizeof(m->kstack), 0);
    m->flags = s->flags;
    if (events.perf_submit(ctx, m, sizeof(*m)) != 0) {
        /* nothing of it can reach user space: counted, per user too */
        tally_add(CRT_LOST);
        struct uid_budget *b = budgets.lookup(&uid);
        if (b)
            __sync_fetch_and_add(&b->lost, 1);
        return 0;
    }

    if (sp && !light)
        send_stack(ctx, s, sp);

    if (procs.lookup(&tgid)) {
        progs.call(ctx, 0);         /* crash_py */
        s->flags |= CRF_PY_CALL;    /* the tail call failed */
    }
    send_end(ctx, s);
    return 0;
}

/* The first of the other threads' PyThreadStates: the list of the main
 * interpreter (main_interp, 3.12+: every thread that runs in a
 * subinterpreter called from there, and has a state there), else of the
 * crashing thread's interpreter (0: none, or not read). */
static __always_inline u64 thread_list(struct crash_state *s, u64 tstate, u64 main_interp)
{
    struct crash_layout *lay = &s->lay;
    if (!tstate || lay->tstate_interp < 0 || lay->interp_threads_head < 0 || lay->tstate_next < 0)
        return 0;
    int failed = 0;
    u64 interp = main_interp ? main_interp : read_u64(tstate + lay->tstate_interp, &failed);
    u64 head = failed || !interp ? 0 : read_u64(interp + lay->interp_threads_head, &failed);
    if (failed)
        s->flags |= CRF_OTHERS_READ;
    return failed ? 0 : head;
}

/* The next program once a thread's objects are copied: the next thread's
 * frames, or the end. */
static __always_inline void after_thread(void *ctx, struct crash_state *s)
{
    if (s->next_ts) {
        progs.call(ctx, 2);         /* crash_other */
        s->flags |= CRF_OBJS_LEFT;  /* the tail call failed: the tail calls ran out */
    }
    send_end(ctx, s);
}

/* A thread's frames sent; then the objects they name (crash_code), or
 * the next thread. */
static __always_inline void send_frames(void *ctx, struct crash_state *s, struct crash_py *p)
{
    submit(ctx, s, p, sizeof(*p));
    s->frame = 0;
    s->obj = 0;
    if (p->st.depth) {
        progs.call(ctx, 1);         /* crash_code */
        s->flags |= CRF_CODE_CALL;  /* the tail call failed */
        send_end(ctx, s);
        return;
    }
    after_thread(ctx, s);
}

/* The thread's Python frames, then the objects they name. */
int crash_py(struct bpf_raw_tracepoint_args *ctx)
{
    int zero = 0;
    struct crash_state *s = state.lookup(&zero);
    struct crash_py *p = pybuf.lookup(&zero);
    if (!s || !p)
        return 0;
    u32 tgid = s->tgid;
    struct proc_info *pi = procs.lookup(&tgid);
    struct crash_layout *lay = layouts.lookup(&tgid);
    if (!pi || !lay) {
        send_end(ctx, s);
        return 0;
    }
    s->lay = *lay;
    fill_hdr(&p->h, s, CR_PYSTACK, 0);
    p->thread = s->tid;
    u64 thread_ptr = 0;
    p->tstate = current_tstate(pi, &thread_ptr);
    walk_python(pi, &p->st, tgid, p->tstate, 0, thread_ptr);
    s->self_ts = p->tstate;
    s->next_ts = thread_list(s, p->tstate, pi->main_interp);
    s->others = 0;
    send_frames(ctx, s, p);
    return 0;
}

/* The next other thread of the interpreter: its frames, walked from its
 * PyThreadState as the crashing thread's were, then its objects. */
int crash_other(struct bpf_raw_tracepoint_args *ctx)
{
    int zero = 0;
    struct crash_state *s = state.lookup(&zero);
    struct crash_py *p = pybuf.lookup(&zero);
    if (!s || !p)
        return 0;
    u32 tgid = s->tgid;
    struct proc_info *pi = procs.lookup(&tgid);
    struct crash_layout *lay = &s->lay;
    int failed = 0;
    u64 ts = s->next_ts;
    if (ts == s->self_ts)           /* the crashing thread's: sent first */
        ts = read_u64(ts + lay->tstate_next, &failed);
    if (!pi || !ts || failed || ++s->others > CR_MAX_OTHERS) {
        s->flags |= failed ? CRF_OTHERS_READ : 0;
        send_end(ctx, s);
        return 0;
    }
    s->next_ts = read_u64(ts + lay->tstate_next, &failed);
    u32 tid = 0;
    if (lay->tstate_native_thread_id >= 0) {
        tid = (u32)read_u64(ts + lay->tstate_native_thread_id, &failed);
    } else if (lay->tstate_thread_id >= 0) {
        u64 pthread = read_u64(ts + lay->tstate_thread_id, &failed);
        if (pthread)
            bpf_probe_read_user(&tid, sizeof(tid), (void *)(pthread + lay->pthread_tid));
    }
    if (failed) {
        s->flags |= CRF_OTHERS_READ;
        s->next_ts = 0;
    }
    fill_hdr(&p->h, s, CR_PYSTACK, 0);
    p->thread = tid;
    p->tstate = ts;
    walk_python(pi, &p->st, tgid, ts, 0, 0);
    send_frames(ctx, s, p);
    return 0;
}

/* Copy one object into a CR_MEM record: its bytes as CodeReader reads
 * them (crash_layout), exactly, so that a read of it in user space is
 * answered from the copy.  kind 0: a code object (and the pointers to its
 * name, file and line table into s->ptrs), 1-2: a str, 3: a bytes. */
static __always_inline void copy_object(void *ctx, struct crash_state *s, struct crash_mem *b,
                                        u64 addr, u32 kind)
{
    struct crash_layout *lay = &s->lay;
    u64 n;
    if (kind == 0) {
        n = lay->code_span;
    } else if (kind < 3) {
        /* PyASCIIObject: length, state; the data after the header (compact
         * ASCII at ascii_data, other compact kinds at compact_data; a legacy
         * string's data is elsewhere, not copied) */
        s64 length = 0;
        u32 st = 0;
        if (bpf_probe_read_user(&length, 8, (void *)(addr + lay->unicode_length)) != 0 ||
            bpf_probe_read_user(&st, 4, (void *)(addr + lay->unicode_state)) != 0) {
            s->flags |= CRF_MEM_FAILED;
            return;
        }
        if (length < 0 || length > 1024)    /* code.py's MAX_STR: it reads no more */
            length = length < 0 ? 0 : 1024;
        u32 skind = (st >> 2) & 7;
        if ((st >> 5) & 1 && (st >> 6) & 1)
            n = lay->ascii_data + length;
        else if ((st >> 5) & 1)
            n = lay->compact_data + length * skind;
        else
            n = lay->compact_data + 8;      /* the data pointer: user space reads no further */
    } else {
        s64 size = 0;
        if (bpf_probe_read_user(&size, 8, (void *)(addr + lay->bytes_size)) != 0) {
            s->flags |= CRF_MEM_FAILED;
            return;
        }
        if (size < 0)
            size = 0;
        n = lay->bytes_data + size;
    }
    if (n > CR_MEM_MAX) {
        n = CR_MEM_MAX;
        s->flags |= CRF_MEM_CUT;
    }
    if (n == 0)
        return;
    if (bpf_probe_read_user(b->data, n, (void *)addr) != 0) {
        s->flags |= CRF_MEM_FAILED;
        return;
    }
    if (kind == 0) {
        s->ptrs[1] = *(u64 *)(b->data + (lay->code_name & (CR_CODE_MAX - 8)));
        s->ptrs[2] = *(u64 *)(b->data + (lay->code_filename & (CR_CODE_MAX - 8)));
        s->ptrs[3] = *(u64 *)(b->data + (lay->code_linetable & (CR_CODE_MAX - 8)));
    }
    fill_hdr(&b->h, s, CR_MEM, (u32)n);
    b->addr = addr;
    submit(ctx, s, b, offsetof(struct crash_mem, data) + n);
    s->objects++;
}

/* CR_OBJS_PER_PROG objects a run: each distinct code object of the frames
 * (walking outwards), then its name, file and line table; then the next
 * run, by a tail call (the verifier walks a bounded loop once per turn:
 * one loop over every frame and object would be too long for it). */
int crash_code(struct bpf_raw_tracepoint_args *ctx)
{
    int zero = 0;
    struct crash_state *s = state.lookup(&zero);
    struct crash_py *p = pybuf.lookup(&zero);
    u32 cpu = bpf_get_smp_processor_id();
    struct crash_mem *b = (struct crash_mem *)bigbuf.lookup(&cpu);
    if (!s || !p || !b)
        return 0;
    u32 depth = p->st.depth;
    for (int i = 0; i < CR_OBJS_PER_PROG; i++) {
        u32 f = s->frame;
        if (f >= depth || f >= MAX_PY_DEPTH)
            break;
        u32 obj = s->obj;
        u64 addr;
        if (obj == 0)
            addr = p->st.frames[f & PY_MASK].code;
        else
            addr = s->ptrs[obj & 3];
        /* the next object: a code object seen already is skipped with its own */
        if (obj >= 3) {
            s->obj = 0;
            s->frame = f + 1;
        } else {
            s->obj = obj + 1;
        }
        struct crash_seen k = {s->id, addr};
        u8 one = 1;
        if (!addr || seen.insert(&k, &one) != 0) {
            if (obj == 0) {
                s->obj = 0;
                s->frame = f + 1;
            }
            continue;
        }
        if (obj == 0)               /* a copy that fails names nothing: its objects are skipped */
            s->ptrs[1] = s->ptrs[2] = s->ptrs[3] = 0;
        copy_object(ctx, s, b, addr, obj);
    }
    if (s->frame < depth) {
        progs.call(ctx, 1);         /* crash_code, again */
        s->flags |= CRF_OBJS_LEFT;
        send_end(ctx, s);
        return 0;
    }
    after_thread(ctx, s);
    return 0;
}


#include "crashlife.c" /* inline */
