/* Native user stacks from .eh_frame tables (DWARF CFI), for code built
 * without frame pointers.  Pasted into pyoffcpu.bpf.c by the loader before
 * capture() (bcc rewrites map calls only in the main file).
 *
 * The main programs (on_cpu_sample, sched_switch) keep their key in
 * unwind_scratch and end with a tail call to unwind_perf / unwind_tp, which
 * walk the native stack (when unwind_prepare() found tables and user
 * registers; frame pointers via bpf_get_stackid otherwise) and record the
 * sample or the off-CPU interval start.  Ending the main programs with the
 * tail call also keeps their verification cheap: each instruction after the
 * Python walk is verified once per state the walk ends in.
 *
 * User space (pytool/pyoffcpu/unwind/) turns the .eh_frame of every
 * executable mapping of a target into a sorted table of rows (one per change
 * of the unwind rule, 8 bytes each).  Each file's table is an array map of
 * its own, exactly its size, written through mmap and put in a slot of
 * `unwind_files` (an array of maps), once however many processes map the
 * file; per process, `unwind_procs` lists its executable mappings (sorted
 * by start) and the slots of their tables.  User space frees a table by
 * clearing its slot once no process refers to it; the kernel frees the
 * array after the programs that may still hold it are done.
 *
 * The walk starts from the thread's user registers (bpf_task_pt_regs: the
 * registers saved at kernel entry, right for a sample taken in kernel mode
 * and at sched_switch alike) and takes UNWIND_FRAMES_PER_CALL frames per
 * program run; it continues by tail-calling itself, so the verifier sees a
 * small program and the depth is still MAX_NATIVE_DEPTH.  The finished
 * stack is stored once in `nstacks` under its hash (like Python stacks),
 * and the sample or the off-CPU interval start is recorded by the last run.
 *
 * Per frame: find the mapping (binary search), the row (page index, then
 * binary search), compute the CFA (rsp or rbp + offset; the word at rbp +
 * offset for a realigned stack, UR_DRAP; rbx + offset in the leaf, UR_RBX),
 * read the return address at CFA-8 and the saved rbp if the row says where
 * it is.  Code with no table (JIT, a table that did not fit) is walked by
 * frame pointer.  Each caller frame is counted under the method that found
 * it (native_stack.methods).
 *
 * Set by the loader at load time (loadconst.h):
 *   PT_REGS_IP_OFF, PT_REGS_SP_OFF, PT_REGS_BP_OFF, PT_REGS_BX_OFF, PT_REGS_CS_OFF   (BTF)
 */

#include "unwind_defs.h"

/* Frames per program run.  The verifier's time grows with it (it follows
 * the loop once per frame): 8 took 0.64 s per program here, 4 takes ~0.3 s,
 * the longest part of a warm start; the run time per sample measured the
 * same (a tail call costs a few ns beside a frame's lookups).  The kernel
 * follows 33 tail calls in a chain: sched_switch -> memo_tp, then 32 runs of
 * unwind_tp (4 frames each for MAX_NATIVE_DEPTH 128) is 33 of them; 3
 * frames would be 44. */
#ifndef UNWIND_FRAMES_PER_CALL
#define UNWIND_FRAMES_PER_CALL 4
#endif
_Static_assert((MAX_NATIVE_DEPTH + UNWIND_FRAMES_PER_CALL - 1) / UNWIND_FRAMES_PER_CALL + 1 <= 33,
               "a walk's chain of tail calls would pass the kernel's 33");
#define UNWIND_MAX_CALLS ((MAX_NATIVE_DEPTH + UNWIND_FRAMES_PER_CALL - 1) / UNWIND_FRAMES_PER_CALL)
#define UNWIND_MAP_MASK (MAX_UNWIND_MAPS - 1)
#define NATIVE_MASK (MAX_NATIVE_DEPTH - 1)

static __always_inline void add_time(struct stack_key *key, u64 ns);
static __always_inline void owed_recorded(struct unwind_state *s);     /* pyoffcpu.bpf.c */

/* The template of a file's table (user space makes each one its own size:
 * BPF_F_INNER_MAP) and the slots that hold them. */
BPF_F_TABLE("array", u32, struct unwind_row, unwind_files_inner, 1, BPF_F_MMAPABLE | BPF_F_INNER_MAP);
BPF_ARRAY_OF_MAPS(unwind_files, "unwind_files_inner", MAX_UNWIND_FILES);
BPF_F_TABLE("hash", u32, struct proc_unwind, unwind_procs, MAX_UNWIND_PROCS, BPF_F_NO_PREALLOC);
BPF_F_TABLE("hash", u64, struct native_stack, nstacks, 32768, BPF_F_NO_PREALLOC);
BPF_PERCPU_ARRAY(unwind_scratch, struct unwind_state, 3);   /* 0: on-CPU, 1: sched_switch, 2: sched_waking */
/* Per process: pcs found in no mapping of unwind_procs.  User space reads
 * the process's maps again when this grows (a library just loaded). */
BPF_F_TABLE("hash", u32, u64, unwind_misses, MAX_UNWIND_PROCS, BPF_F_NO_PREALLOC);
/* Per file whose table is still being built (its id, unwind_map.npages):
 * the walks that stopped there.  User space builds the files that stacks
 * reach first. */
BPF_F_TABLE("hash", u32, u64, unwind_pending, MAX_UNWIND_PENDING, BPF_F_NO_PREALLOC);
BPF_PROG_ARRAY(unwind_perf_progs, 1);
BPF_PROG_ARRAY(unwind_tp_progs, 2);     /* 0: unwind_tp, 1: memo_tp (the entry) */
BPF_PROG_ARRAY(unwind_wake_progs, 2);   /* --wakers: 0 unwind_wake, 1 memo_wake (the entry) */

/* The mapping holding pc, or 0.  maps[] is sorted by start and its
 * mappings are disjoint, so the one that holds pc is the only answer: the
 * mapping of the frame before (*hint) is tried first, and most callers are
 * in the same object as their callee. */
static __always_inline struct unwind_map *unwind_find_map(struct proc_unwind *pu, u64 pc, u32 *hint)
{
    u32 n = pu->n;
    if (n == 0 || n > MAX_UNWIND_MAPS)
        return 0;
    u32 h = *hint;
    if (h < n) {
        struct unwind_map *last = &pu->maps[h & UNWIND_MAP_MASK];
        if (pc >= last->start && pc < last->end)
            return last;
    }
    u32 lo = 0, hi = n;             /* the answer is in [lo, hi) */
#pragma clang loop unroll(disable)
    for (int i = 0; i < UNWIND_MAP_STEPS; i++) {
        if (hi - lo <= 1)
            break;
        u32 mid = (lo + hi) >> 1;
        if (pu->maps[mid & UNWIND_MAP_MASK].start <= pc)
            lo = mid;
        else
            hi = mid;
    }
    struct unwind_map *m = &pu->maps[lo & UNWIND_MAP_MASK];
    if (pc < m->start || pc >= m->end)
        return 0;
    *hint = lo;
    return m;
}

/* The row in force at rel (bytes from the table base), or 0. */
static __always_inline struct unwind_row *unwind_find_row(struct unwind_map *m, u64 rel)
{
    u32 nrows = m->nrows, npages = m->npages, slot = m->file;
    u32 lo, hi, k;
    void *table = unwind_files.lookup(&slot);
    if (!table)                     /* freed meanwhile: no row, never another file's */
        return 0;
    u64 p = rel >> (m->page_shift & 31);
    if (p >= npages) {
        lo = hi = nrows - 1;
    } else {
        k = (u32)p;
        struct unwind_row *a = bpf_map_lookup_elem(table, &k);
        k++;
        struct unwind_row *b = bpf_map_lookup_elem(table, &k);
        if (!a || !b)
            return 0;
        lo = a->pc;
        hi = b->pc;
    }
    u32 rows = npages + 1;          /* the rows follow the page index */
#pragma clang loop unroll(disable)
    for (int i = 0; i < UNWIND_SEARCH_STEPS; i++) {
        if (lo >= hi)
            break;
        u32 mid = (lo + hi + 1) >> 1;
        k = rows + mid;
        struct unwind_row *r = bpf_map_lookup_elem(table, &k);
        if (!r)
            return 0;
        if (r->pc <= rel)
            lo = mid;
        else
            hi = mid - 1;
    }
    if (lo != hi)
        return 0;
    k = rows + lo;
    struct unwind_row *r = bpf_map_lookup_elem(table, &k);
    if (!r || r->pc > rel)
        return 0;
    return r;
}

/* Note a stack word the walk read, for the switch memo, with its class
 * (MEMO_*, unwind_defs.h); returns its index. */
static __always_inline u32 memo_word(struct unwind_state *s, u64 addr, u64 val, u8 cls)
{
    u32 n = s->memo.nw;
    if (n >= MEMO_WORDS) {
        s->memo.ok = 0;
        return MEMO_SRC_CONST;
    }
    s->memo.addr[n & (MEMO_WORDS - 1)] = addr;
    s->memo.val[n & (MEMO_WORDS - 1)] = val;
    s->memo.cls[n & (MEMO_WORDS - 1)] = cls;
    s->memo.nw = n + 1;
    if (addr < s->memo.lo)
        s->memo.lo = addr;
    if (addr + 8 > s->memo.hi)
        s->memo.hi = addr + 8;
    return n;
}

/* The walk computes with bp (a CFA or an address from it): the word it
 * came from is a stack address the memo must find moved with the stack. */
static __always_inline void memo_bp_used(struct unwind_state *s)
{
    u32 src = s->bp_src;
    if (src < MEMO_WORDS)
        s->memo.cls[src & (MEMO_WORDS - 1)] = MEMO_PTR;
    else if (src == MEMO_SRC_LEAF)
        s->memo.leaf_bp_used = 1;
    else
        s->memo.ok = 0;             /* a constant: no moved stack gives it */
}

/* n (8 or 16) bytes of the stack at addr into out; 0 when they cannot be
 * read.  One bpf_probe_read_user costs about the same for 8 bytes as for
 * 256 (30 ns here; 4 KiB: 67 ns), and a frame's words lie above the last
 * one's, so the walk copies the stack from the word it needs to the end of
 * its page and takes the next words from that copy while they are in it:
 * the same bytes as reading each word on its own, at the same moment of the
 * walk.  The copy never crosses a page end: a read that fails costs more
 * than many that do not (the fault path), and the page above the top of a
 * stack is not mapped. */
static __always_inline int stack_read(struct unwind_state *s, u64 addr, void *out, u32 n)
{
    if (!in_copy(s->win_lo, s->win_len, addr, n)) {     /* pyoffcpu.bpf.c */
        u64 len = 4096 - (addr & 4095);     /* to the page end */
        if (len < n)
            len = n;                        /* the words cross it: just them */
        if (len > UNWIND_WIN)
            len = UNWIND_WIN;
        s->win_len = 0;
        if (bpf_probe_read_user(s->win, len, (void *)addr) != 0)
            return 0;
        s->win_lo = addr;
        s->win_len = len;
    }
    u64 off = (addr - s->win_lo) & (UNWIND_WIN - 1);
    ((u64 *)out)[0] = *(u64 *)(s->win + off);
    if (n == 16)
        ((u64 *)out)[1] = *(u64 *)(s->win + off + 8);
    return 1;
}

/* The rows found by the searches below, per CPU, by pc: a row is a pure
 * function of the pc and the tables of the process, and a process's tables
 * never change under one proc_unwind.gen (unique per write of its entry;
 * the switch memo rests on the same fact), so an entry whose tgid, gen and
 * pc are the frame's holds the row the searches would find.  Server code
 * walks the same few hundred return addresses over and over, and the
 * searches (about 12 lookups in a 16 MiB array) are most of a frame's cost. */
#define ROW_CACHE 2048              /* entries per CPU; power of two */
struct row_cache_ent {
    u64 pc;
    u32 tgid, gen;
    struct unwind_row row;
    u32 map;                        /* index in maps[] of the mapping */
    u32 pad;
};
BPF_PERCPU_ARRAY(row_cache, struct row_cache_ent, ROW_CACHE);

/* The unwind rule in force at pc: 1 with *out set; 0 when its mapping has
 * no table (or pc is in none: NST_UNMAPPED set); -1 when the table has no
 * row for it; -2 when its table is not built yet (NST_PENDING set: the walk
 * stops there, frame pointers would guess). */
static __always_inline int unwind_rule(struct unwind_state *s, struct proc_unwind *pu, u64 pc,
                                       struct unwind_row *out)
{
    u32 slot = (u32)((pc * 0x9E3779B97F4A7C15ULL) >> 53) & (ROW_CACHE - 1);
    struct row_cache_ent *ce = row_cache.lookup(&slot);
    if (!ce)
        return -1;                  /* cannot happen: slot < ROW_CACHE */
    if (!(ce->pc == pc && ce->tgid == s->st.tgid && ce->gen == pu->gen)) {
        struct unwind_map *m = unwind_find_map(pu, pc, &s->map_hint);
        if (!m) {
            s->st.flags |= NST_UNMAPPED;
            return 0;
        }
        if (m->file == UNWIND_FILE_PENDING) {
            u32 id = m->npages;
            s->st.flags |= NST_PENDING;
            unwind_pending.atomic_increment(id);
            return -2;
        }
        if (!m->nrows)
            return 0;
        u64 rel = pc - m->base;
        if (rel >> 32)
            return -1;
        struct unwind_row *r = unwind_find_row(m, rel);
        if (!r)
            return -1;
        ce->pc = pc;
        ce->tgid = s->st.tgid;
        ce->gen = pu->gen;
        ce->row = *r;
        ce->map = s->map_hint;
    }
    /* one way out, hit or miss: the verifier follows what comes next once */
    *out = ce->row;
    s->map_hint = ce->map;
    return 1;
}

/* One frame: record pc, then step to the caller.  Returns 0 to go on. */
static __always_inline int unwind_step(struct unwind_state *s, struct proc_unwind *pu)
{
    u64 pc = s->pc, sp = s->sp, bp = s->bp;
    u32 d = s->st.depth;
    if (d >= MAX_NATIVE_DEPTH) {
        s->st.flags |= NST_TRUNCATED;
        return 1;
    }
    s->st.pcs[d & NATIVE_MASK] = pc;
    s->st.depth = d + 1;
    s->hash = mix(s->hash, pc);

    /* Return addresses point after the call: look the caller up at pc - 1
     * (a call can be the last instruction of a function). */
    u64 lookup_pc = d == 0 ? pc : pc - 1;
    u64 cfa = 0, ra = 0;
    s64 rbp_at = 0;                 /* rbp saved at CFA + rbp_at, 0: unchanged */
    int bp_rule = 0;                /* 1: rbp lost; 2: the word at this frame's rbp */
    u32 method = METHOD_TABLE;
    struct unwind_row row;
    int found = unwind_rule(s, pu, lookup_pc, &row);
    if (found == -2)
        return 1;                   /* as far as the tables built so far allow */
    if (found == 0 && (s->st.flags & NST_UNMAPPED)) {
        /* A pc in no mapping of the process's entry: anonymous memory, JIT
         * code (every file mapping is registered, with or without a table),
         * or a library loaded since user space last looked (it looks again:
         * unwind_misses).  Frame pointers there would guess: JIT code keeps
         * rbp as a general register, or leaves the caller's, which skips
         * the frame that called it.  The walk ends. */
        s->st.flags |= NST_INCOMPLETE;
        return 1;
    }
    if (found < 0) {
        s->st.flags |= NST_INCOMPLETE;
        return 1;
    }
    if (found) {
        struct unwind_row *r = &row;
        u8 kind = r->kind & ~UR_DERIVED;
        if (r->kind & UR_DERIVED) {
            s->st.flags |= NST_PROLOGUE;
            method = METHOD_PROLOGUE;
        }
        if (kind == UR_END)
            return 1;               /* the outermost frame: a complete stack */
        if (kind == UR_RSP) {
            cfa = sp + r->cfa_off;
        } else if (kind == UR_RBP) {
            cfa = bp + r->cfa_off;
            memo_bp_used(s);
        } else if (kind == UR_PLT) {
            cfa = sp + r->cfa_off + ((lookup_pc & 15) >= (u64)r->rbp ? 8 : 0);
        } else if (kind == UR_DRAP) {
            /* the CFA was kept in the frame before rsp was realigned */
            u64 at = bp + r->cfa_off;
            memo_bp_used(s);
            if (!stack_read(s, at, &cfa, 8)) {
                s->st.flags |= NST_INCOMPLETE;
                return 1;
            }
            memo_word(s, at, cfa, MEMO_PTR);
        } else if (kind == UR_RBX && d == 0) {
            /* rbx is known in the leaf only (the sampled registers); deeper,
             * what a callee did with it is not followed */
            cfa = s->bx + r->cfa_off;
            s->memo.uses_bx = 1;
        } else {
            s->st.flags |= NST_INCOMPLETE;
            return 1;
        }
        if (kind != UR_PLT) {
            s64 rb = ROW_RBP(r);
            if (rb == RBP_LOST)
                bp_rule = 1;
            else if (rb == RBP_AT_RBP)
                bp_rule = 2;
            else
                rbp_at = rb * 8;
        }
    } else {
        /* A file mapping without a table (none could be made, or it did
         * not fit): frame pointers. */
        if (bp <= sp || bp - sp > (8ULL << 20)) {
            s->st.flags |= NST_INCOMPLETE;
            return 1;
        }
        s->st.flags |= NST_FRAMEPOINTER;
        method = METHOD_FP;
        cfa = bp + 16;
        rbp_at = -16;
        memo_bp_used(s);
    }
    if (cfa <= sp && d > 0) {
        s->st.flags |= NST_INCOMPLETE;     /* no progress: a bad rule, or garbage */
        return 1;
    }
    if (rbp_at == -16) {
        /* the common case, push rbp first: both words in one read */
        u64 two[2] = {};
        if (!stack_read(s, cfa - 16, two, 16)) {
            s->st.flags |= NST_INCOMPLETE;
            return 1;
        }
        bp = two[0];
        ra = two[1];
        s->bp_src = memo_word(s, cfa - 16, bp, MEMO_FREE);
        memo_word(s, cfa - 8, ra, MEMO_RA);
    } else {
        if (!stack_read(s, cfa - 8, &ra, 8)) {
            s->st.flags |= NST_INCOMPLETE;
            return 1;
        }
        memo_word(s, cfa - 8, ra, MEMO_RA);
        if (bp_rule == 2)
            memo_bp_used(s);        /* the caller's rbp is the word at this one's */
        u64 bp_addr = bp_rule == 2 ? bp : cfa + rbp_at;
        if (rbp_at || bp_rule == 2) {
            if (!stack_read(s, bp_addr, &bp, 8)) {
                bp = 0;
                s->memo.ok = 0;     /* a failed read cannot be checked again */
            } else {
                s->bp_src = memo_word(s, bp_addr, bp, MEMO_FREE);
            }
        } else if (bp_rule == 1) {
            bp = 0;
            s->bp_src = MEMO_SRC_CONST;
        }
    }
    if (ra == 0)
        return 1;                   /* the end of the chain */
    s->st.methods[method & (METHODS - 1)]++;
    s->pc = ra;
    s->sp = cfa;
    s->bp = bp;
    return 0;
}

/* User registers of the current thread into s; 0 when it has none. */
static __always_inline int unwind_regs(struct unwind_state *s)
{
    return current_user_regs(&s->pc, &s->sp, &s->bp, &s->bx);   /* pyoffcpu.bpf.c */
}

/* Set up the walk of the current thread's user stack: its registers into
 * the per-CPU state, ready = 1 when the walk can run (the process has
 * tables and the thread user registers).  Called before the Python walk,
 * so that its branches are not multiplied by the walk's verifier states;
 * unwind_ready() then hands the key over. */
static __always_inline int unwind_prepare(u32 tgid, int slot)
{
    struct unwind_state *s = unwind_scratch.lookup(&slot);
    if (!s)
        return 0;
    s->ready = 0;
    if (!NATIVE_UNWIND)
        return 0;
    struct proc_unwind *pu = unwind_procs.lookup(&tgid);
    if (!pu)
        return 0;
    if (!unwind_regs(s))
        return 0;
    s->calls = 0;
    s->map_hint = MAX_UNWIND_MAPS;  /* none yet */
    s->win_len = 0;
    s->st.tgid = tgid;
    s->st.depth = 0;
    s->st.flags = 0;
    *(u32 *)s->st.methods = 0;
    s->hash = 0xcbf29ce484222325ULL ^ tgid;
    s->memo.pc = s->pc;
    s->memo.sp = s->sp;
    s->memo.bp = s->bp;
    s->memo.bx = s->bx;
    s->memo.uses_bx = 0;
    s->memo.leaf_bp_used = 0;
    s->memo.tgid = tgid;
    s->memo.gen = pu->gen;
    s->memo.nw = 0;
    s->memo.ok = 1;
    s->memo.lo = ~0ULL;
    s->memo.hi = 0;
    s->bp_src = MEMO_SRC_LEAF;
    u64 fsbase = 0;
    bpf_probe_read_kernel(&fsbase, sizeof(fsbase), (void *)(bpf_get_current_task() + TASK_FSBASE_OFF));
    s->sp_off = (s64)(s->sp - fsbase);
    s->ready = 1;
    return 1;
}

/* Walk up to UNWIND_FRAMES_PER_CALL frames; 1 when the stack is finished. */
static __always_inline int unwind_run(struct unwind_state *s)
{
    u32 tgid = s->key.tgid;
    struct proc_unwind *pu = unwind_procs.lookup(&tgid);
    if (!pu) {
        s->st.flags |= NST_INCOMPLETE;
        return 1;
    }
#pragma clang loop unroll(disable)
    for (int i = 0; i < UNWIND_FRAMES_PER_CALL; i++) {
        if (unwind_step(s, pu))
            return 1;
    }
    s->calls++;
    if (s->calls >= UNWIND_MAX_CALLS) {
        s->st.flags |= NST_TRUNCATED;
        return 1;
    }
    return 0;
}

/* Store the finished stack and put its hash in the key; 0 when the stack
 * could not be stored (user space will not be able to read it). */
static __always_inline int unwind_store(struct unwind_state *s)
{
    int stored = 1;
    /* the methods are a function of the pcs and the tables, mixed in all the
     * same: a stack's entry never stands for one found another way */
    u64 h = mix(s->hash, s->st.flags | ((u64)*(u32 *)s->st.methods << 32));
    if (h == 0)
        h = 1;
    if (!nstacks.lookup(&h)) {
        if (nstacks.insert(&h, &s->st) != 0) {
            count_drop(DROP_NSTACK_FULL);
            stored = 0;
        }
    }
    s->key.nstack = h;
    if (s->st.flags & NST_INCOMPLETE)
        count_drop(DROP_NSTACK_INCOMPLETE);
    if (s->st.flags & NST_UNMAPPED) {
        u32 tgid = s->st.tgid;
        unwind_misses.atomic_increment(tgid);
    }
    return stored;
}

/* The unwinder programs: one per program type (tail calls stay within one). */
/* The finishing programs, one per program type (tail calls stay within
 * one): the main programs leave the key in unwind_scratch and tail-call
 * them; they walk the native stack when unwind_prepare() set it up,
 * tail-calling themselves every UNWIND_FRAMES_PER_CALL frames, then
 * record the sample or the off-CPU interval start. */
int unwind_perf(struct bpf_perf_event_data *ctx)
{
    int slot = 0;
    struct unwind_state *s = unwind_scratch.lookup(&slot);
    if (!s)
        return 0;
    if (s->ready) {
        if (!unwind_run(s)) {
            unwind_perf_progs.call(ctx, 0);
            s->st.flags |= NST_TRUNCATED;   /* the tail call failed */
        }
        s->ready = 0;
        unwind_store(s);
    }
    add_time(&s->key, SAMPLE_PERIOD_NS);
    if (TIMELINE) {
        char comm[16];
        bpf_get_current_comm(comm, sizeof(comm));
        timeline_send(ctx, &s->key, bpf_ktime_get_ns(), 0, comm);
    }
    return 0;
}
