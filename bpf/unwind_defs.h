/* Structs of the native unwinder shared by bpf/unwind.c and the loader
 * (constants reach user space through pytool/pyoffcpu/bpfdefs.py; the rows
 * are written by unwind/table.py, whose layout test checks them). */
#ifndef PYOFFCPU_UNWIND_DEFS_H
#define PYOFFCPU_UNWIND_DEFS_H

#ifndef MAX_NATIVE_DEPTH
#define MAX_NATIVE_DEPTH 128        /* power of two */
#endif
#define MAX_UNWIND_MAPS 256         /* executable mappings per process; power of two */
#define UNWIND_MAP_STEPS 9          /* log2(MAX_UNWIND_MAPS) + 1 */
#define UNWIND_SEARCH_STEPS 10      /* rows per page <= 1 << UNWIND_SEARCH_STEPS */
#define MAX_UNWIND_FILES 16384      /* tables loaded at once (one per file): slots of unwind_files */
#define MAX_UNWIND_PROCS 16384      /* processes with tables (unwind_procs, not preallocated) */
#define UNWIND_FILE_PENDING 0xFFFFFFFFU   /* unwind_map.file of a table not built yet */
#define MAX_UNWIND_PENDING 16384    /* files waiting for their tables, counted in unwind_pending */
#define UNWIND_WIN 4096             /* bytes of stack read at once (at most a page); power of two */

/* unwind_row.kind */
#define UR_INVALID 0                /* no rule the unwinder can follow: stop */
#define UR_RSP     1                /* CFA = rsp + cfa_off */
#define UR_RBP     2                /* CFA = rbp + cfa_off */
#define UR_PLT     3                /* CFA = rsp + cfa_off + ((pc & 15) >= rbp ? 8 : 0) */
#define UR_END     4                /* return address undefined: outermost frame */
#define UR_DRAP    5                /* CFA = the word at rbp + cfa_off (GCC's stack realignment
                                       keeps the CFA in the frame: DW_OP_breg6 N; DW_OP_deref) */
#define UR_RBX     6                /* CFA = rbx + cfa_off: the leaf frame only, where rbx is the
                                       sampled register (prologue analysis: mov %rsp, %rbx) */
#define UR_DERIVED 0x80             /* flag: a row from prologue analysis, not from an FDE
                                       (pytool/pyoffcpu/unwind/prologue.py) */
#define RBP_LOST   (-128)           /* rbp cannot be recovered in the caller */
#define RBP_AT_RBP 127              /* the caller's rbp is the word at this frame's rbp
                                       (DW_CFA_expression: rbp (DW_OP_breg6 0), with UR_DRAP) */
#define ROW_RBP(r) ((s64)(signed char)(r)->rbp)

/* The rule from pc on; also the page index entries (pc = row index). */
struct unwind_row {
    unsigned int pc;                /* bytes from the table base */
    short cfa_off;
    unsigned char kind;
    unsigned char rbp;              /* as signed char: rbp saved at CFA + 8 * rbp;
                                       0: unchanged, RBP_LOST, RBP_AT_RBP
                                       (bcc's ctypes know no signed char) */
};

/* One executable mapping of a process. */
struct unwind_map {
    unsigned long long start, end;  /* runtime addresses */
    unsigned long long base;        /* runtime address of the table's pc 0 */
    unsigned int file;              /* slot in unwind_files: the array of the file's
                                       table (the page index, then the rows);
                                       UNWIND_FILE_PENDING: not built yet */
    unsigned int npages;            /* page index entries - 1; rows follow the index
                                       (a pending file: its id in unwind_pending) */
    unsigned int nrows;             /* 0: no table, walk by frame pointer */
    unsigned int page_shift;
};

struct proc_unwind {
    unsigned int n;
    unsigned int gen;               /* unique per write of this entry: a switch memo
                                       made with other tables never matches */
    struct unwind_map maps[MAX_UNWIND_MAPS];   /* sorted by start */
};

/* native_stack.flags */
#define NST_TRUNCATED    1          /* deeper than MAX_NATIVE_DEPTH: root-side frames lost */
#define NST_INCOMPLETE   2          /* stopped at a frame it could not unwind */
#define NST_FRAMEPOINTER 4          /* some frames were found by frame pointer */
#define NST_UNMAPPED     8          /* a pc in no mapping known to unwind_procs */
#define NST_PROLOGUE     16         /* some frames were unwound by prologue-analysis rows */
#define NST_PENDING      32         /* stopped at a mapping whose table is still being built */

/* native_stack.methods: frames found by each method, one byte each */
#define METHOD_TABLE     0          /* a row from an FDE */
#define METHOD_PROLOGUE  1          /* a row from prologue analysis (UR_DERIVED) */
#define METHOD_FP        2          /* frame pointer: code without a table */
#define METHODS          4          /* bytes of methods (one spare) */

struct native_stack {
    unsigned int tgid;
    unsigned int depth;
    unsigned int flags;
    unsigned char methods[METHODS]; /* caller frames found by each METHOD_* (the leaf
                                       frame is the sampled pc: no method) */
    unsigned long long pcs[MAX_NATIVE_DEPTH];  /* innermost first */
};

/* Switch memo: the inputs of one native walk, complete.  A walk is a
 * function of the leaf registers (pc, sp, bp), the process's tables (gen)
 * and the stack words it read; when all of them are equal the walk gives
 * the same stack, so a thread that blocks again with the same registers and
 * the same words at the same addresses reuses it, exactly.
 *
 * The same holds for a stack at another place (another thread's, or the
 * same thread deeper or higher): moved by d bytes, with every stack address
 * the walk computed with moved by d too, it reads the same return addresses
 * at addresses d away and gives the same stack.  What the walk computes
 * with are sp, and bp where a rule bases the CFA on it (or the frame
 * pointer walk, or GCC's realigned frames): so each word read keeps its
 * class, MEMO_RA (a return address: the same value), MEMO_PTR (a stack
 * address the walk went on from: the same value + d) or MEMO_FREE (a saved
 * rbp never used after: CPython keeps objects in rbp; any value); the leaf
 * bp and bx likewise (leaf_bp_used, uses_bx).  A walk never compares a
 * stack address with anything but another one, and its reads either all
 * succeed or it is not kept (ok), so d changes nothing else.  The words are
 * checked with one read of [lo + d, hi + d). */
#define MEMO_WORDS 256              /* power of two: two words a frame */
#define MEMO_SPAN  16384            /* bytes of stack one check may read; power of two */
#define MEMO_RA    0
#define MEMO_PTR   1
#define MEMO_FREE  2
/* memo_stats (bpf/memo.c) */
#define MEMO_HIT_THREAD 0
#define MEMO_HIT_SHARED 1
#define MEMO_WALKED     2
#define MEMO_CHECKED    3
#define MEMO_WRONG      4
#define MEMO_HIT_WAKE   5
#define MEMO_STATS      6
#define MEMO_SRC_LEAF  0xFFFF       /* unwind_state.bp_src: bp is the leaf's register */
#define MEMO_SRC_CONST 0xFFFE       /* ... a constant (a rule said it is lost) */
struct switch_memo_t {
    unsigned long long pc, sp, bp;
    unsigned long long bx;          /* the leaf's rbx, an input only when uses_bx */
    unsigned long long nstack;      /* the walk's result: its hash in nstacks */
    unsigned long long lo, hi;      /* the words lie in [lo, hi) */
    unsigned int tgid;
    unsigned int gen;               /* proc_unwind.gen of the tables used */
    unsigned int nw;
    unsigned int ok;                /* every read of the walk is in addr/val */
    unsigned int uses_bx;           /* the walk based a CFA on the leaf's rbx (UR_RBX) */
    unsigned int leaf_bp_used;      /* ... or on the leaf's rbp */
    unsigned long long addr[MEMO_WORDS];
    unsigned long long val[MEMO_WORDS];
    unsigned char cls[MEMO_WORDS];  /* MEMO_* of each word */
};
/* The shared memo's key: a walk any thread of the process may reuse, found
 * by its leaf pc and its sp's distance from the thread pointer (glibc puts
 * a thread's struct pthread at the top of its stack: threads doing the same
 * thing block at the same distance).  The key only finds a candidate; the
 * check above decides. */
struct xmemo_key {
    unsigned int tgid, gen;
    unsigned long long pc;
    long long sp_off;               /* sp - fsbase */
};

/* In-flight walk, per CPU: what the last unwinder run records. */
struct unwind_state {
    struct stack_key key;
    unsigned long long ts;          /* sched_switch: start of the off-CPU interval;
                                       sched_waking: the wakeup */
    unsigned long long pc, sp, bp;
    unsigned long long bx;          /* the leaf's rbx (UR_RBX) */
    unsigned long long hash;
    unsigned int calls;
    unsigned int ready;             /* set up by unwind_prepare() */
    unsigned int map_hint;          /* index in maps[] of the last frame's mapping */
    unsigned int win_len;           /* bytes of the stack in win, from win_lo; 0: none */
    unsigned int wakee;             /* sched_waking: the thread woken (key: the waker's) */
    unsigned int bp_src;            /* the memo word bp was read from, or MEMO_SRC_* */
    long long sp_off;               /* the leaf sp - the thread pointer (xmemo_key) */
    unsigned long long verify;      /* MEMO_VERIFY: the stack the memo gave, to compare */
    unsigned long long owed_ns;     /* rseq_update: the weight of the wait captured (owed = 1) */
    unsigned int owed;              /* 1: the key is an owed capture (add it), 0: a switch-out's */
    unsigned int owed_pad;
    unsigned long long win_lo;
    unsigned char win[UNWIND_WIN + 16];  /* a copy of the stack the walk is in */
    struct native_stack st;
    struct switch_memo_t memo;      /* the words this walk read (sched_switch) */
};

#endif
