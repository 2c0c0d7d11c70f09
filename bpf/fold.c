/* pyoffcpu.bpf.c's part: the kernel's fold of ended threads (fold_exit).
 * Pasted into pyoffcpu.bpf.c by the loader. */

/* --- The kernel's fold of ended threads (pyoffcpu.h) --- */

static __always_inline int is_on_cpu(u32 kind)
{
    return (kind & ~(3U << GIL_SHIFT)) == KIND_ONCPU;
}

static __always_inline void agg_add(struct stack_key *k, u64 count, u64 ns)
{
    struct stack_value init = {};
    struct stack_value *v = agg.lookup_or_try_init(k, &init);
    if (!v) {
        count_drop_ns(DROP_AGG_FULL, ns);
        return;
    }
    __sync_fetch_and_add(&v->count, count);
    __sync_fetch_and_add(&v->ns, ns);
}

/* The id of the group of a process, entry stack and name (0: none, the
 * group map is full). */
static __always_inline u32 group_of(u32 tgid, u64 pystack, struct thread_t *th)
{
    int zero = 0;
    struct group_id_key gk = {};
    gk.tgid = tgid;
    gk.pystack = pystack;
    __builtin_memcpy(&gk.comm0, th->comm, 16);
    u32 *id = group_ids.lookup(&gk);
    if (id)
        return *id;
    /* a new id, unique without an atomic whose result is used (the BPF
     * target bcc compiles for has none): this CPU's count, and the CPU */
    u32 cpu = bpf_get_smp_processor_id();
    u64 *made = group_count.lookup(&zero);
    if (!made || cpu > 255)
        return 0;
    *made += 1;
    u32 fresh = (u32)(*made << 8) | cpu;
    if (fresh & GROUP_TID)
        return 0;
    group_ids.insert(&gk, &fresh);     /* another CPU may have made it first */
    id = group_ids.lookup(&gk);
    return id ? *id : 0;
}

/* fold_exit's running values, per CPU.  Kept in a map value, not in
 * registers: the verifier then sees the same unknown values on every path
 * through a loop's body, and prunes (in registers, 32 iterations of three
 * loops passed its million instructions). */
struct fold_state {
    u64 count[MAX_HELD], ns[MAX_HELD];  /* each held key's, read once (ns 0: gone) */
    u64 total, samples;             /* the thread's on-CPU ns and samples */
    u64 exact, left;                /* its exact on-CPU ns; what is left of it to share */
    u64 best;                       /* the Python stack with the most time */
    s64 best_ns;
    u32 last_on;                    /* index of its last on-CPU key (MAX_HELD: none) */
    u32 wall;                       /* FOLD_WALL: on-CPU keys are scaled */
    u32 unknown;                    /* a stack not in stack_class */
    u32 pad;
};
BPF_PERCPU_ARRAY(fold_scratch, struct fold_state, 1);

/* The on-CPU time of held key i once scaled to the thread's exact on-CPU
 * time, as user space scales a thread's samples (ThreadAccounts.scale_on_cpu):
 * ns * exact / total, the rest to the last on-CPU key. */
static __always_inline u64 fold_ns(struct fold_state *fs, u32 i, u32 kind, u64 ns)
{
    if (!fs->wall || !is_on_cpu(kind))
        return ns;
    if (i == fs->last_on)
        return fs->left;
    u64 share = ns * fs->exact / fs->total;     /* < 2^64: both below FOLD_SCALE_MAX */
    fs->left -= share;
    return share;
}

/* Tail-called by sched_switch at the last switch of a thread whose keys are
 * held (TH_HELD): its keys leave its held_keys entry for agg.  Folded (FOLD_WALL / FOLD_OFFCPU):
 * each under its group's tid, the on-CPU ones scaled to the thread's exact
 * on-CPU time, and the thread's times added to the group; its thread entry
 * goes.  Not folded (a key did not fit, times too long for the scaling, no
 * group id left) or FOLD_SHADOW: under its own tid too, for user space,
 * which then closes and folds it as any ended thread.  The group is that of
 * the thread's Python stack with the most time (after the scaling) among
 * those with an entry function, as user space picks it; a thread with a
 * stack user space has not classified yet is left to it. */
int fold_exit(struct bpf_raw_tracepoint_args *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id, tgid = id >> 32;
    int zero = 0;
    struct control_t *ctl = control.lookup(&zero);
    struct thread_t *th = threads.lookup(&tid);
    struct held_t *h = held_keys.lookup(&tid);
    struct fold_state *fs = fold_scratch.lookup(&zero);
    if (!ctl || !th || !h || !fs)
        return 0;
    u32 mode = ctl->fold & FOLD_MODE_MASK;
    u32 n = h->n;
    fs->wall = mode == FOLD_WALL;
    fs->exact = fs->wall ? th->on_ns : 0;
    fs->total = fs->samples = 0;
    fs->last_on = MAX_HELD;
    u32 i;
    /* each key's count and ns; the on-CPU total, the samples, the last on-CPU key */
#pragma clang loop unroll(disable)
    for (i = 0; i < MAX_HELD; i++) {
        if (i >= n)
            break;
        u32 j = i & (MAX_HELD - 1);
        u64 count = h->vals[j].count, ns = h->vals[j].ns;
        fs->count[j] = count;
        fs->ns[j] = ns;
        if (!is_on_cpu(h->keys[j].kind))
            continue;
        fs->total += ns;
        fs->samples += count;
        fs->last_on = i;
    }
    int fold = mode && !h->overflow && fs->exact < FOLD_SCALE_MAX && fs->total < FOLD_SCALE_MAX;
    /* the heaviest Python stack that has an entry function, the first of
     * equals, as user space picks it (ThreadAccounts.fold) */
    fs->best = 0;
    fs->best_ns = -1;
    fs->unknown = 0;
    fs->left = fs->exact;
#pragma clang loop unroll(disable)
    for (i = 0; fold && i < MAX_HELD; i++) {
        if (i >= n)
            break;
        u32 j = i & (MAX_HELD - 1);
        u64 py = h->keys[j].pystack;
        if (!fs->count[j] && !fs->ns[j])
            continue;                   /* (made by an add of nothing: 0 events, 0 ns) */
        s64 ns = fold_ns(fs, i, h->keys[j].kind, fs->ns[j]);
        if (!py)
            continue;
        u8 *c = stack_class.lookup(&py);
        if (!c) {
            fs->unknown = 1;            /* user space has not seen it yet */
            continue;
        }
        if (*c == STACK_ENTRY && ns > fs->best_ns) {
            fs->best_ns = ns;
            fs->best = py;
        }
    }
    if (fs->unknown)
        fold = 0;
    u32 gid = fold ? group_of(tgid, fs->best, th) : 0;
    if (!gid)
        fold = 0;
    int own = !fold || (ctl->fold & FOLD_SHADOW);
    u32 gen = ctl->gen;
    fs->left = fs->exact;
#pragma clang loop unroll(disable)
    for (i = 0; i < MAX_HELD; i++) {
        if (i >= n)
            break;
        u32 j = i & (MAX_HELD - 1);
        u64 count = fs->count[j], ns = fs->ns[j];
        if (!count && !ns)
            continue;
        struct stack_key d;
        __builtin_memcpy(&d, &h->keys[j], sizeof(d));
        d.gen = gen;
        if (own)
            agg_add(&d, count, ns);
        if (fold) {
            d.tid = GROUP_TID | gid;
            agg_add(&d, count, fold_ns(fs, i, d.kind, ns));
        }
    }
    /* Its KIND_SHORT totals, still in its entry (sched_switch leaves them
     * to this): straight to its group, and to its own tid where user space
     * closes it.  Through agg under its tid, as every other key, each would
     * cost six map operations more (made, listed, looked up and deleted),
     * and a short-lived thread's waits are mostly these. */
#pragma unroll
    for (i = 0; i < SHORT_SLOTS; i++) {
        u64 sn = th->short_n[i], sns = th->short_ns[i];
        if (!sn)
            continue;
        struct stack_key d;
        short_key(th, tid, i, &d);
        d.gen = gen;
        if (own)
            agg_add(&d, sn, sns);
        if (fold) {
            d.tid = GROUP_TID | gid;
            agg_add(&d, sn, sns);
        }
        th->short_n[i] = 0;
        th->short_ns[i] = 0;
    }
    if (fold) {
        /* what user space adds at a thread's end (close_thread, scale_on_cpu) */
        struct stack_key d = {};
        d.tgid = tgid;
        d.tid = GROUP_TID | gid;
        d.kstack = -1;
        d.gen = gen;
        if (th->unseen_ns) {
            d.ustack = USTACK_NO_STACK;
            d.kind = KIND_OTHER;
            agg_add(&d, 1, th->unseen_ns);
        }
        if (fs->wall && fs->total == 0 && fs->exact > 0) {
            d.ustack = USTACK_UNSAMPLED;
            d.kind = KIND_ONCPU;
            agg_add(&d, 0, fs->exact);
        }
        struct group_key gk = {};
        gk.id = gid;
        gk.gen = gen;
        gk.cpu = bpf_get_smp_processor_id();
        struct group_t blank = {};
        struct group_t *g = groups.lookup_or_try_init(&gk, &blank);
        if (g) {
            u64 first = th->first_ts ? th->first_ts : th->last_ts;
            if (!g->threads || first < g->first_ts) {
                g->first_ts = first;
                g->first_tid = tid;
            }
            if (th->last_ts > g->last_ts)
                g->last_ts = th->last_ts;
            g->threads += 1;
            g->on_ns += fs->exact;
            g->samples += fs->samples;
        }
    }
    if (own)                            /* user space's to close */
        th->flags = (th->flags & ~TH_HELD) | (fold ? TH_KFOLDED : 0);
    else
        threads.delete(&tid);
    held_keys.delete(&tid);
    return 0;
}
