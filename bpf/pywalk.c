/* What the profiler (pyoffcpu.bpf.c) and the crash watcher (crashes.bpf.c)
 * read the same way: the current thread's PyThreadState (current_tstate)
 * and its frames (walk_python), and whether an exiting thread ends its
 * process (last_thread_exits).  Inlined by the loader (its include is
 * marked `inline`: it uses maps, which bcc rewrites only in the main file).
 *
 * The includer provides: pyoffcpu.h (with it loadconst.h: TASK_FSBASE_OFF,
 * EXIT_GROUP_DEAD and ASYNC_TASKS, set at load time unless the includer
 * defines them first, as crashes.bpf.c does ASYNC_TASKS) and count_drop(idx)
 * (the DROP_* counters). */

/* At sched_process_exit, in the exiting thread: does the process end with
 * it?  The tracepoint says so (group_dead) where the kernel passes it
 * (EXIT_GROUP_DEAD, from BTF); elsewhere the group leader's exit stands in. */
static __always_inline int last_thread_exits(struct bpf_raw_tracepoint_args *ctx)
{
    if (EXIT_GROUP_DEAD)
        return (u8)ctx->args[1];
    u64 id = bpf_get_current_pid_tgid();
    return (u32)id == (u32)(id >> 32);
}

#ifndef PY_MASK
#define PY_MASK (MAX_PY_DEPTH - 1)
#endif

static __always_inline u64 read_u64(u64 addr, int *failed)
{
    u64 v = 0;
    if (bpf_probe_read_user(&v, sizeof(v), (void *)addr) != 0)
        *failed = 1;
    return v;
}

/* The current thread's PyThreadState, as pthread_getspecific(autoTSSkey)
 * would return it, or from 3.15 the thread-local _Py_tss_gilstate: the
 * gilstate binding survives while a thread blocks with the GIL released
 * (3.12+ clear _Py_tss_tstate then; see reference §7).  Both lie at a fixed
 * distance from the thread pointer (the %fs base, glibc's struct pthread). */
static __always_inline u64 current_tstate(struct proc_info *pi, u64 *thread_ptr)
{
    int key = pi->tss_key;
    int specific = pi->pthread_specific;
    s64 distance;
    if (key >= 0 && key < 32 && specific >= 0)  /* only glibc's first block of keys */
        /* struct pthread_key_data { uintptr_t seq; void *data; } specific_1stblock[32] */
        distance = specific + key * 16 + 8;
    else if (pi->tstate_tls)
        distance = pi->tstate_tls;
    else
        return 0;
    u64 task = bpf_get_current_task();
    u64 fsbase = 0;
    bpf_probe_read_kernel(&fsbase, sizeof(fsbase), (void *)(task + TASK_FSBASE_OFF));
    if (!fsbase)
        return 0;
    *thread_ptr = fsbase;           /* glibc's and musl's pthread_self() */
    int failed = 0;
    return read_u64(fsbase + distance, &failed);
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

/* The fields of a frame the walk needs all lie in its first bytes (3.11
 * _PyInterpreterFrame: owner at 69, 3.12/3.13: 70, 3.14: 74; <= 3.10
 * PyFrameObject: f_lasti at 104 at most).  Offsets are masked to 127.
 *
 * A bpf_probe_read_user costs about the same for 80 bytes as for 1 KiB
 * (30 ns; 4 KiB: 67 ns), and from 3.11 on a thread's frames lie one under
 * the other in its data stack (`previous` at a lower address): the walk
 * reads from the start of the page of the frame it needs to the frame's
 * end, and takes the frames below it from that copy while they are in it.
 * The copy never leaves the frame's page on the low side: a read that
 * fails costs more than many that do not (the fault path), and the page
 * under a data-stack chunk is often not mapped.  The bytes are the ones a
 * read of each frame would give, at the same point of the walk.  <= 3.10
 * frames are objects on the heap, one read each.  (The native unwinder's
 * stack_read, bpf/unwind.c, copies the same way, upward.) */
#define IFRAME_WINDOW 80
#define FRAMEOBJ_WINDOW 112
#define PYWIN 4096
#define FRAME_OFF(off) ((u64)(off) & 127)
struct frame_win {
    u64 lo, len;                    /* the copy in b: [lo, lo + len) of the target */
    u64 below;                      /* a refill starts at f & below */
    /* a subinterpreter's thread state: its mark, written where its frames
     * end, then the walk goes on at next_chain (walk_python) */
    u64 mark_interp;                /* 0: none (any more) */
    u64 mark_word;                  /* its flags << 32 | its id */
    u64 next_chain;
    u64 stamp_code, stamp;          /* the last code object stamped, its stamp */
    u64 mix, text_end;              /* code_stamp's */
    u8 cs[CODE_STAMP_SPAN + 64];    /* code_stamp's copies: of the code object, */
    u8 ns[NAME_STAMP_SPAN + 32];    /* of its qualified name (room past the reads
                                       for the masked offsets) */
    u8 b[PYWIN + 136];
};
/* Per CPU, one for each program that may run while another's walk is under
 * way on that CPU, as `scratch`'s slots: 0 the on-CPU sample (a perf event
 * program runs in the timer's interrupt, which can come in the middle of a
 * raw tracepoint program's walk), 1 sched_switch and rseq_capture (which
 * never run beside each other), 2 sched_waking.  One shared slot let a
 * sample overwrite a switch's window mid-walk: that wait's Python stack came
 * out torn (CI's deep recursion test, off-CPU waits with 63 of 128 frames). */
#define FRAME_WIN_SLOTS 3
BPF_PERCPU_ARRAY(frame_win, struct frame_win, FRAME_WIN_SLOTS);

/* The stamp of the code object at `code` (py_frame.stamp; proc_info says
 * what it mixes): two reads, the code object's span and its qualified
 * name's; odd when read, 0 when the code object could not be read (without
 * the name's, its part alone).  Straight-line and without
 * a branch on what was read (a comparison is one here, and each would
 * double the verifier's paths at every frame): a word left out is mixed as
 * zero, "a - b < 0" is the top bit of a - b, every value far below 2^63.
 * The running mix is kept in the map value: the walk around this leaves
 * few registers free.  User space computes the same from its own reads
 * (cpython/code.py: CodeReader.stamp). */
static __always_inline u64 stamp_mix(u64 h, u64 w)
{
    return (h ^ w) * CODE_STAMP_PRIME;
}

static __always_inline u64 code_stamp(struct proc_info *pi, struct frame_win *win, u64 code)
{
    if (bpf_probe_read_user(win->cs, CODE_STAMP_SPAN, (void *)(code + ((u64)pi->code_stamp_lo & 255))) != 0)
        return 0;
    u64 ptrs = (u64)pi->code_stamp_ptrs & 127;
    u64 sel = (u64)pi->code_stamp_words;
    win->mix = stamp_mix(CODE_STAMP_SEED, *(u64 *)win->cs);            /* the first line's word */
    win->mix = stamp_mix(win->mix, *(u64 *)(win->cs + ptrs) & -(sel & 1));
    win->mix = stamp_mix(win->mix, *(u64 *)(win->cs + ptrs + 8) & -((sel >> 1) & 1));
    win->mix = stamp_mix(win->mix, *(u64 *)(win->cs + ptrs + 16) & -((sel >> 2) & 1));
    win->mix = stamp_mix(win->mix, *(u64 *)(win->cs + ptrs + 24) & -((sel >> 3) & 1));
    u64 name = *(u64 *)(win->cs + ((u64)pi->code_stamp_name & 127));
    if (bpf_probe_read_user(win->ns, NAME_STAMP_SPAN, (void *)(name + ((u64)pi->name_stamp_lo & 255))) != 0)
        return win->mix | 1;        /* no name to read: the code object's part */
    u32 state = *(u32 *)(win->ns + ((u64)pi->name_stamp_state & 31));
    u64 len = *(u64 *)win->ns;
    u64 text = (u64)pi->name_stamp_text & 63;
    u64 on = (u64)pi->name_stamp_on & 1;
    u64 ascii = (state >> 5) & (state >> 6) & 1;        /* compact ASCII */
    u64 short_ = ((len - 4096) >> 63) & ~(len >> 63);
    u64 end = (text + (len & 4095) + 1) & -(ascii & short_ & on);  /* its text, with its NUL */
    win->mix = stamp_mix(win->mix, len & -on);
    win->mix = stamp_mix(win->mix, *(u64 *)(win->ns + text) & -(((end - text - 8) >> 63) ^ 1));
    win->mix = stamp_mix(win->mix, *(u64 *)(win->ns + text + 8) & -(((end - text - 16) >> 63) ^ 1));
    return win->mix | 1;
}

/* Do [addr, addr + n) lie in the copy of [lo, lo + len)?  Written so that
 * nothing wraps around, whatever addr holds. */
static __always_inline int in_copy(u64 lo, u64 len, u64 addr, u64 n)
{
    return len >= n && addr >= lo && addr - lo <= len - n;
}

/* Subinterpreters.  A thread that runs code in another interpreter
 * (_interpreters.exec, concurrent.interpreters) has a thread state in each:
 * the gilstate binding that current_tstate reads is the inner one, and the
 * main interpreter's state of the same thread, whose frames called into the
 * other, is on its thread list with the same pthread_self().  Found by a
 * walk of that list, at most MAX_MAIN_THREADS long, once per inner thread
 * state: the answer is kept per thread (outer_tstates) and checked at each
 * use (the outer state still names this thread).  A thread started in the
 * subinterpreter has no outer state; nor is one looked for in an
 * interpreter between the two (a subinterpreter that calls into a third):
 * that one's frames are not shown. */
#define MAX_MAIN_THREADS 256
struct outer_tstate {
    u64 inner;                      /* the thread state it was found for */
    u64 outer;                      /* 0: none */
};
BPF_TABLE("lru_hash", u32, struct outer_tstate, outer_tstates, 4096);

static __always_inline u64 outer_tstate(struct proc_info *pi, u64 tstate, u64 thread_ptr)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    int failed = 0;
    struct outer_tstate *known = outer_tstates.lookup(&tid);
    if (known && known->inner == tstate) {
        u64 outer = known->outer;
        if (!outer)
            return 0;
        if (read_u64(outer + pi->tstate_thread_id, &failed) == thread_ptr && !failed)
            return outer;
    }
    u64 ts = read_u64(pi->main_interp + pi->interp_threads_head, &failed);
    u64 found = 0;
    for (int i = 0; i < MAX_MAIN_THREADS; i++) {
        if (!ts || failed)
            break;
        if (read_u64(ts + pi->tstate_thread_id, &failed) == thread_ptr && !failed) {
            found = ts;
            break;
        }
        ts = read_u64(ts + pi->tstate_next, &failed);
    }
    if (failed)
        return 0;                   /* not known: looked for again next time */
    struct outer_tstate v = {.inner = tstate, .outer = found};
    outer_tstates.update(&tid, &v);
    return found;
}

/* Walk the Python frames of the current thread into st; returns the stack's
 * hash (0: no Python frames).
 *
 * One loop for every layout: <= 3.10 a PyFrameObject chain (f_back, f_code,
 * f_lasti; each frame is one _PyEval_EvalFrameDefault call), 3.11+ a
 * _PyInterpreterFrame chain (previous, f_code / f_executable, instr_ptr,
 * owner, is_entry).  What differs is chosen before the loop (offsets, the
 * window's size, a mask `iframes` that picks each field's formula without a
 * branch), and the hash is mixed as the frames are read: the verifier walks
 * a bounded loop once per iteration, so every branch or extra loop here is
 * paid MAX_PY_DEPTH times at every start, and every instruction at every
 * capture.  A failed read ends the walk; shim frames are recorded like any
 * other (user space drops them by their owner). */
static __always_inline u64 walk_python(struct proc_info *pi, struct pystack *st, u32 tgid,
                                       u64 tstate, int slot, u64 thread_ptr)
{
    st->depth = 0;
    st->flags = 0;
    st->task_frame = 0;
    st->tgid = tgid;
    st->epoch = pi->epoch;
    if (pi->walker == WALK_NONE || !tstate)
        return 0;
    int failed = 0;
    u64 f = first_frame(pi, tstate, &failed);
    if (failed) {
        count_drop(DROP_PY_READ);
        return 0;
    }
    /* A thread state of a subinterpreter (main_interp: 3.12+): its frames
     * end in a PYF_INTERP mark, then the thread's in the main interpreter,
     * where it has a state there (thread_ptr: the current thread's; 0 when
     * walking another thread, which is not looked for). */
    struct frame_win *win = frame_win.lookup(&slot);
    if (!win)
        return 0;
    /* Kept in the map value, not in registers, as below: the loop's
     * verifier states stay the same whether or not it met a mark. */
    win->mark_interp = win->next_chain = 0;
    if (pi->main_interp) {
        u64 interp = read_u64(tstate + pi->tstate_interp, &failed);
        if (!failed && interp && interp != pi->main_interp) {
            u64 flags = PYF_INTERP;
            if (pi->interp_ceval_gil >= 0 &&
                read_u64(interp + pi->interp_ceval_gil, &failed) != pi->main_gil)
                flags |= PYF_OWN_GIL;
            u32 id = (u32)read_u64(interp + pi->interp_id, &failed);
            u64 outer = thread_ptr ? outer_tstate(pi, tstate, thread_ptr) : 0;
            int bad = 0;
            u64 next = outer ? first_frame(pi, outer, &bad) : 0;
            win->mark_interp = interp;
            win->mark_word = flags << 32 | id;
            win->next_chain = bad ? 0 : next;
        }
        failed = 0;
    }
    u8 *w = win->b;
    u64 off_code, off_prev, off_instr, off_owner, off_entry, size;
    u64 iframes;                    /* all ones for 3.11+, 0 for <= 3.10 */
    if (pi->walker == WALK_FRAMEOBJ) {
        iframes = 0;
        size = FRAMEOBJ_WINDOW;
        off_code = FRAME_OFF(pi->frame_code);
        off_prev = FRAME_OFF(pi->frame_back);
        off_instr = FRAME_OFF(pi->frame_lasti);     /* f_lasti, an int */
        off_owner = off_entry = off_code;           /* unused */
    } else {
        iframes = ~0ULL;
        size = IFRAME_WINDOW;
        off_code = FRAME_OFF(pi->iframe_code);
        off_prev = FRAME_OFF(pi->iframe_previous);
        off_instr = FRAME_OFF(pi->iframe_instr);
        off_owner = FRAME_OFF(pi->iframe_owner);
        /* 3.12+ have no is_entry: read the owner byte twice, and ignore it */
        off_entry = FRAME_OFF(pi->iframe_is_entry >= 0 ? pi->iframe_is_entry : pi->iframe_owner);
    }
    /* <= 3.10: every frame is an entry; 3.11: is_entry; 3.12+: none */
    u32 entry_flag = pi->walker == WALK_ISENTRY ? PYF_ENTRY : 0;
    u32 frameobj_flags = (u32)~iframes & PYF_ENTRY;
    s64 adaptive = pi->code_code_adaptive;
    u64 h = mix(0xcbf29ce484222325ULL ^ tgid, pi->epoch);
    /* Kept in the map value, not in registers: the verifier then sees the
     * same unknown values on every path through the loop body, and prunes. */
    win->below = ~(4095 & iframes);     /* 3.11+: from the frame's page start */
    win->lo = win->len = 0;
    win->stamp_code = win->stamp = 0;
    u64 task_frame = 0;
    u32 i;
    for (i = 0; i < MAX_PY_DEPTH; i++) {
        if (!f) {
            /* the end of a subinterpreter's frames: its mark, then the
             * outer thread state's frames (if any) */
            u64 mi = win->mark_interp;
            if (!mi)
                break;
            u64 word = win->mark_word;
            struct py_frame *mark = &st->frames[i & PY_MASK];
            mark->code = mi;
            mark->offset = (int)(u32)word;
            mark->flags = (u32)(word >> 32);
            mark->stamp = 0;
            h = mix(h, mi);
            h = mix(h, word);
            win->mark_interp = 0;
            f = win->next_chain;
            continue;
        }
        if (!in_copy(win->lo, win->len, f, size)) {
            win->lo = f & win->below;
            u64 n = f + size - win->lo;
            if (n > PYWIN + 112)
                n = PYWIN + 112;
            win->len = n;
            if (bpf_probe_read_user(w, n, (void *)win->lo) != 0) {
                st->flags |= PYS_READ_FAILED;
                break;
            }
        }
        u64 lo = win->lo;
        u8 *fw = w + ((f - lo) & (PYWIN - 1));
        u64 code = *(u64 *)(fw + off_code) & ~3ULL; /* 3.14 tags f_executable; code objects are 8-aligned */
        u64 prev = *(u64 *)(fw + off_prev);
        u64 instr = *(u64 *)(fw + off_instr);
        u32 owner = fw[off_owner];
        u32 is_entry = fw[off_entry];
        /* 3.11+: bytes into the bytecode; <= 3.10: f_lasti as stored */
        u32 offset = (u32)((instr - code - adaptive) & iframes) | ((u32)instr & ~(u32)iframes);
        u32 flags = ((owner | ((is_entry & 1) << 8 & entry_flag)) & (u32)iframes) | frameobj_flags;
        struct py_frame *pf = &st->frames[i & PY_MASK];
        pf->code = code;
        pf->offset = (int)offset;
        pf->flags = flags;
        /* a recursion's frames share one code object: stamped once */
        if (code != win->stamp_code) {
            win->stamp_code = code;
            win->stamp = code_stamp(pi, win, code);
        }
        u64 stamp = win->stamp;
        pf->stamp = stamp;
        h = mix(h, code);
        h = mix(h, stamp);
        h = mix(h, ((u64)flags << 32) | offset);
        if (ASYNC_TASKS) {
            /* owner == FRAME_OWNED_BY_GENERATOR (1, 3.11+), without a branch:
             * the last one met, walking outwards, is the task's coroutine */
            u64 x = (u64)((owner ^ 1) & 0xff) | ~iframes;
            u64 gen_mask = ((x | -x) >> 63) - 1;    /* all ones when x == 0 */
            task_frame = (f & gen_mask) | (task_frame & ~gen_mask);
        }
        f = prev;
    }
    if (f && i >= MAX_PY_DEPTH) {
        st->flags |= PYS_TRUNCATED;
        count_drop(DROP_PY_TRUNCATED);
    }
    if (st->flags & PYS_READ_FAILED)
        count_drop(DROP_PY_READ);
    st->depth = i;
    if (i == 0)
        return 0;
    h = mix(h, st->flags);
    if (ASYNC_TASKS) {
        st->task_frame = task_frame;
        h = mix(h, task_frame);
    }
    if (h == 0)
        h = 1;
    st->hash = h;
    return h;
}
