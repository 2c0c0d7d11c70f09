/* unwind.c's second half: the memo of native stacks at switches (a walk
 * reused while the thread's stack is unchanged), and the finishing programs
 * of switches and wakeups (memo_tp, unwind_tp, memo_wake, unwind_wake).
 * Pasted into pyoffcpu.bpf.c by the loader, after unwind.c. */

/* Per thread: the inputs and result of its last complete native walk at a
 * switch-out.  Entries go when the thread exits. */
BPF_F_TABLE("hash", u32, struct switch_memo_t, switch_memo, 8192, BPF_F_NO_PREALLOC);
struct memo_buf_t { u8 b[MEMO_SPAN + 8]; };
BPF_PERCPU_ARRAY(memo_buf, struct memo_buf_t, 1);

/* Threads of one process whose walks start at the same pc at the same depth
 * under their thread pointer: the last complete walk there, any thread's
 * (unwind_defs.h, xmemo_key). */
BPF_F_TABLE("lru_hash", struct xmemo_key, struct switch_memo_t, xmemo, 2048, 0);

/* Does memo m hold for the walk about to start (s: leaf registers and the
 * tables' gen set by unwind_prepare)?  With the stack moved by d = the new
 * sp - m's: every word m's walk read is read again, d bytes away, in one
 * read of the span they lie in, and must be what its class says. */
static __always_inline struct switch_memo_t *memo_match(struct unwind_state *s,
                                                        struct switch_memo_t *m)
{
    if (!m)
        return 0;
    u64 d = s->memo.sp - m->sp;
    if (m->tgid != s->memo.tgid || m->gen != s->memo.gen || m->pc != s->memo.pc ||
        (m->leaf_bp_used && s->memo.bp - m->bp != d) || (m->uses_bx && s->memo.bx - m->bx != d))
        return 0;
    u32 nw = m->nw;
    if (nw == 0 || nw > MEMO_WORDS || m->hi <= m->lo)
        return 0;
    u64 span = m->hi - m->lo;
    if (span > MEMO_SPAN)
        return 0;
    int zero = 0;
    struct memo_buf_t *buf = memo_buf.lookup(&zero);
    if (!buf)
        return 0;
    if (bpf_probe_read_user(buf->b, span, (void *)(m->lo + d)) != 0)
        return 0;
    /* Branch-free body (the verifier follows every jump of every iteration):
     * lo <= addr <= hi - 8 holds for every word by construction, the mask
     * only keeps the verifier sure of it.  A word's expected value: its own
     * (MEMO_RA), + d (MEMO_PTR); MEMO_FREE words are not compared. */
    u64 diff = 0;
#pragma clang loop unroll(disable)
    for (int i = 0; i < MEMO_WORDS; i++) {
        u32 n = nw;
        asm volatile("" : "+r"(n));     /* or clang counts the loop down from nw, a
                                           bound the verifier cannot follow */
        if (i >= n)
            break;
        u32 j = i & (MEMO_WORDS - 1);
        asm volatile("" : "+r"(j));     /* keep the index: clang would make m->val[i] a
                                           pointer the verifier cannot bound */
        j &= MEMO_WORDS - 1;
        u64 cls = m->cls[j];
        u64 off = (m->addr[j] - m->lo) & (MEMO_SPAN - 1);
        u64 want = m->val[j] + (d & -(u64)(cls == MEMO_PTR));
        u64 keep = -(u64)(cls != MEMO_FREE);
        diff |= (*(u64 *)(buf->b + off) ^ want) & keep;
    }
    if (diff)
        return 0;
    return m;
}

/* The end of a switch-out: the interval starts, with the key made; or of
 * an owed capture (rseq_capture): its weight is added. */
static __always_inline void switch_recorded(struct unwind_state *s)
{
    if (s->owed) {
        owed_recorded(s);
        return;
    }
    u32 tid = s->key.tid;
    struct offcpu_start st = {};
    st.key = s->key;
    st.ts = s->ts;
    if (offcpu_start.update(&tid, &st) != 0)
        count_drop(DROP_START_FULL);
}

/* Switch-outs by how their native stack was found (memo_stats):
 * MEMO_HIT_THREAD the thread's own memo, MEMO_HIT_SHARED another walk of
 * the process (xmemo), MEMO_WALKED walked; with MEMO_VERIFY (tests) every
 * hit is walked all the same and compared: MEMO_CHECKED, MEMO_WRONG. */
#ifndef MEMO_VERIFY
#define MEMO_VERIFY 0
#endif
BPF_PERCPU_ARRAY(memo_stats, u64, MEMO_STATS);

static __always_inline void memo_count(u32 which)
{
    u64 *n = memo_stats.lookup(&which);
    if (n)
        *n += 1;
}

/* A memo stands for the walk about to start: its stack is the key's
 * (MEMO_VERIFY: the walk runs all the same, and is compared at its end). */
static __always_inline int memo_reused(struct unwind_state *s, struct switch_memo_t *m, u32 which)
{
    if (!m)
        return 0;
    memo_count(which);
    if (MEMO_VERIFY) {
        s->verify = m->nstack;
        return 0;
    }
    s->key.nstack = m->nstack;
    s->ready = 0;
    return 1;
}

/* The end of a walk: its stack stored in the key.  1 when the walk may be
 * memorised (complete, and every read checkable): s->memo then holds it. */
static __always_inline int walk_done(struct unwind_state *s)
{
    s->ready = 0;
    int stored = unwind_store(s);
    if (!stored || !s->memo.ok || s->memo.nw == 0 ||
        (s->st.flags & (NST_INCOMPLETE | NST_TRUNCATED | NST_UNMAPPED)))
        return 0;
    s->memo.nstack = s->key.nstack;
    return 1;
}

/* sched_switch's first finishing program: reuse the thread's last native
 * walk when all its inputs hold, else walk (unwind_tp).  A program of its
 * own: its check loop and the walk's loops together exceed what the
 * verifier follows in one program. */
int memo_tp(void *ctx)
{
    int slot = 1;
    struct unwind_state *s = unwind_scratch.lookup(&slot);
    if (!s)
        return 0;
    u32 tid = s->key.tid;
    s->verify = 0;
    if (s->ready) {
        /* the thread's own memo, then the process's; MEMO_VERIFY: the
         * process's first, so that it is what the checks try */
        struct xmemo_key xk = {};
        xk.tgid = s->memo.tgid;
        xk.gen = s->memo.gen;
        xk.pc = s->memo.pc;
        xk.sp_off = s->sp_off;
        u32 which = MEMO_VERIFY ? MEMO_HIT_SHARED : MEMO_HIT_THREAD;
        struct switch_memo_t *m = memo_match(s, MEMO_VERIFY ? xmemo.lookup(&xk) : switch_memo.lookup(&tid));
        if (!m) {
            which = MEMO_VERIFY ? MEMO_HIT_THREAD : MEMO_HIT_SHARED;
            m = memo_match(s, MEMO_VERIFY ? switch_memo.lookup(&tid) : xmemo.lookup(&xk));
        }
        if (!memo_reused(s, m, which)) {
            if (!s->verify)
                memo_count(MEMO_WALKED);
            unwind_tp_progs.call(ctx, 0);
            s->ready = 0;           /* the tail call failed: no native stack */
        }
    }
    switch_recorded(s);
    return 0;
}

int unwind_tp(void *ctx)
{
    int slot = 1;
    struct unwind_state *s = unwind_scratch.lookup(&slot);
    if (!s)
        return 0;
    u32 tid = s->key.tid;
    if (s->ready) {
        if (!unwind_run(s)) {
            unwind_tp_progs.call(ctx, 0);
            s->st.flags |= NST_TRUNCATED;
        }
        if (MEMO_VERIFY && s->verify) {
            walk_done(s);
            memo_count(MEMO_CHECKED);
            if (s->verify != s->key.nstack)
                memo_count(MEMO_WRONG);
            s->verify = 0;
            switch_recorded(s);
            return 0;
        }
        if (walk_done(s)) {
            if (switch_memo.update(&tid, &s->memo) != 0)
                count_drop(DROP_MEMO_FULL);
            struct xmemo_key xk = {};
            xk.tgid = s->memo.tgid;
            xk.gen = s->memo.gen;
            xk.pc = s->memo.pc;
            xk.sp_off = s->sp_off;
            xmemo.update(&xk, &s->memo);
        } else {
            switch_memo.delete(&tid);
        }
    }
    switch_recorded(s);
    return 0;
}

static __always_inline void wake_recorded(struct unwind_state *s);     /* pyoffcpu.bpf.c */

/* Per waker thread: its last complete native walk at a wakeup, reused as
 * switch_memo is (a thread wakes others from the same few places: the
 * same registers, the same words on its stack).  Entries go with LRU. */
BPF_F_TABLE("lru_hash", u32, struct switch_memo_t, wake_memo, 4096, 0);

/* sched_waking's finishing programs, as sched_switch's: the waker's last
 * walk when all its inputs hold, else the walk; then its last_waker entry. */
int memo_wake(void *ctx)
{
    int slot = 2;
    struct unwind_state *s = unwind_scratch.lookup(&slot);
    if (!s)
        return 0;
    u32 tid = s->key.tid;
    s->verify = 0;
    if (s->ready && !memo_reused(s, memo_match(s, wake_memo.lookup(&tid)), MEMO_HIT_WAKE)) {
        unwind_wake_progs.call(ctx, 0);
        s->ready = 0;
    }
    wake_recorded(s);
    return 0;
}

int unwind_wake(void *ctx)
{
    int slot = 2;
    struct unwind_state *s = unwind_scratch.lookup(&slot);
    if (!s)
        return 0;
    u32 tid = s->key.tid;
    if (s->ready) {
        if (!unwind_run(s)) {
            unwind_wake_progs.call(ctx, 0);
            s->st.flags |= NST_TRUNCATED;
        }
        if (walk_done(s))
            wake_memo.update(&tid, &s->memo);
        else
            wake_memo.delete(&tid);
    }
    wake_recorded(s);
    return 0;
}
