/* Structs and constants shared by the BPF programs (pyoffcpu.bpf.c) and the
 * loader.  User space reads every `#define NAME value` of this file and of
 * unwind_defs.h through pytool/pyoffcpu/bpfdefs.py (no second copy), and takes
 * struct layouts from bcc's ctypes of the maps. */
#ifndef PYOFFCPU_H
#define PYOFFCPU_H
#include "loadconst.h"

#ifndef MAX_PY_DEPTH
#define MAX_PY_DEPTH 128            /* power of two: index masks below rely on it */
#endif

/* How the frames of a CPython version are chained (see cpython-frames.md §2.3). */
#define WALK_NONE       0           /* not a Python process (yet): native stacks only */
#define WALK_FRAMEOBJ   1           /* <= 3.10: PyFrameObject via tstate->frame, f_back */
#define WALK_ISENTRY    2           /* 3.11: _PyInterpreterFrame, group ends at is_entry */
#define WALK_OWNER      3           /* 3.12+: _PyInterpreterFrame, C-stack shim frames */

/* py_frame.flags */
#define PYF_ENTRY       0x100       /* outermost frame of one _PyEval_EvalFrameDefault call */
#define PYF_OWNER_MASK  0xff        /* 3.11+: the frame's owner byte; 3.12+ shims are
                                       recorded too, user space drops them by owner */
/* Not a frame: the end of the frames of a subinterpreter's thread state (the
 * frames before it, innermost first, ran in that interpreter).  code: the
 * PyInterpreterState, offset: its id; PYF_OWN_GIL: it has a GIL of its own
 * (not the main interpreter's).  The frames after it are the same thread's
 * in the main interpreter (pywalk.c: outer_tstate). */
#define PYF_INTERP      0x200
#define PYF_OWN_GIL     0x400

/* pystack.flags */
#define PYS_TRUNCATED   1           /* more frames than MAX_PY_DEPTH: outermost lost */
#define PYS_READ_FAILED 2           /* a read failed part-way: the stack is partial */

/* The life log: what happened to the processes user space follows, in
 * the order it happened: an exec (or a new process under a target's PID),
 * a fork --subprocesses follows, an exit.  A ring of LIFE_LOG entries,
 * mmap-ed by user space; life_total counts every entry ever written.  An
 * entry is written seqlock-style: seq 0, the fields, then seq = its index
 * + 1, so a reader sees a whole entry or knows it does not. */
#define LIFE_LOG   8192             /* power of two */
#define LIFE_EXEC  1                /* arg: the process's exec count now */
#define LIFE_FORK  2                /* arg: parent tgid | the parent's exec count << 32 */
#define LIFE_EXIT  3                /* its last thread exits (a registered process) */
struct life_event {
    unsigned long long seq;
    unsigned int kind;
    unsigned int tgid;
    unsigned long long arg;
};

/* Per target process: the offsets of its CPython (from offsets_table.py), the
 * pthread key of its tstate and the address of PyCode_Type.  -1 = absent. */
struct proc_info {
    int walker;
    int tss_key;                    /* autoTSSkey's pthread key */
    int pthread_specific;           /* offsetof(struct pthread, specific_1stblock) in
                                       the process's own glibc (pytool/pyoffcpu/libc.py) */
    int tstate_frame;               /* <= 3.10 */
    int tstate_cframe;              /* 3.11 / 3.12 */
    int cframe_current_frame;
    int tstate_current_frame;       /* 3.13+ */
    int frame_back, frame_code, frame_lasti;
    int iframe_code, iframe_previous, iframe_instr, iframe_is_entry, iframe_owner;
    int code_code_adaptive;
    int epoch;                      /* the image: bumped by user space at each exec, and
                                       mixed into the stack hashes, so that a stack of the
                                       new image never matches one of the old */
    /* The GIL (struct _gil_runtime_state): 3.7-3.11 at gil_addr; 3.12+ the
     * one tstate->interp->ceval.gil points to.  gil_holder: offset of its
     * last_holder, `locked` (an int) 8 bytes after it; -1: state not read
     * (free-threaded, or the layout did not check out). */
    int tstate_interp;
    int interp_ceval_gil;           /* 3.12+; -1: the GIL is at gil_addr */
    int gil_holder;
    unsigned long long gil_addr;    /* at 80: no padding (bcc would name it) */
    /* 3.15+: the distance of the thread-local _Py_tss_gilstate from the
     * thread pointer (pytool/pyoffcpu/cpython/tls.py); 0: under tss_key. */
    long long tstate_tls;
    /* The cyclic collector's `collecting` flag (an int), read when the thread
     * holds the GIL (GIL_HELD_GC): at gc_flag when that is not 0 (3.7/3.8:
     * in _PyRuntime), else gc_collecting bytes into tstate->interp; -1: not
     * read (pytool/pyoffcpu/cpython/object_table.py). */
    unsigned long long gc_flag;
    int gc_collecting;
    int gc_pad;
    /* Subinterpreters (3.12+): the main PyInterpreterState (0: not looked
     * for) and its GIL, and the offsets that find a thread's state in the
     * main interpreter when it runs in another (pywalk.c: outer_tstate). */
    unsigned long long main_interp;
    unsigned long long main_gil;
    int interp_id;                  /* offsetof(PyInterpreterState, id) */
    int interp_threads_head;
    int tstate_next;
    int tstate_thread_id;           /* pthread_self() of the thread: its thread pointer */
    /* A code object's stamp (py_frame.stamp, pywalk.c: code_stamp):
     * CODE_STAMP_SPAN bytes read at code + code_stamp_lo (the 8-byte word
     * of its first line), mixed: that word, then the 4 words at
     * code_stamp_ptrs in the copy (file name, name, qualified name, line
     * table; <= 3.10: 3), those code_stamp_words leaves out as zeros; then
     * NAME_STAMP_SPAN bytes of the str at word code_stamp_name of the copy
     * (its qualified name), read at name_stamp_lo (its length), mixed: its
     * length, and the 2 words of its text at name_stamp_text that lie
     * within it and its NUL, where the 32-bit state at name_stamp_state
     * says it is compact ASCII; none of it without name_stamp_on
     * (pytool/pyoffcpu/cpython/code.py: StampLayout). */
    int code_stamp_lo;
    int code_stamp_ptrs;
    int code_stamp_words;
    int code_stamp_name;
    int name_stamp_lo;
    int name_stamp_state;
    int name_stamp_text;
    int name_stamp_on;
};

struct py_frame {
    unsigned long long code;        /* PyCodeObject* */
    int offset;                     /* bytes into the bytecode (<= 3.10: f_lasti as stored) */
    unsigned int flags;
    /* Which code object lay at `code` when the frame was read: a mix of its
     * first line, the addresses of its file name, name, qualified name and
     * line table, and its qualified name's length and first characters
     * (nothing a code object changes while it lives); 0: not read.  A code
     * object's address is reused once it is freed, and its strings' with
     * it: user space names a frame by (code, stamp), never by the address
     * alone, and a stamp that no longer matches what lies there is a code
     * object freed before it could be read (pywalk.c: code_stamp). */
    unsigned long long stamp;
};

#define CODE_STAMP_SPAN   96        /* bytes read per code object */
#define NAME_STAMP_SPAN   48        /* bytes read of its qualified name */
#define CODE_STAMP_SEED   0x9e3779b97f4a7c15ULL
#define CODE_STAMP_PRIME  0x100000001b3ULL

struct pystack {
    unsigned long long hash;        /* key of the stack in pystack_seen */
    unsigned int tgid;
    unsigned int depth;
    unsigned int flags;
    unsigned int epoch;             /* proc_info.epoch of the walk */
    /* --async (ASYNC_TASKS): the outermost frame owned by a generator, the
     * coroutine of the asyncio task the thread runs (it lies inside the
     * coroutine object); mixed into the hash.  0: none, or not --async. */
    unsigned long long task_frame;
    struct py_frame frames[MAX_PY_DEPTH];   /* innermost first */
};

/* What the time is for: on-CPU, or why a thread was off the CPU. */
#define KIND_ONCPU          0
#define KIND_SLEEP          1       /* prev_state S */
#define KIND_RUNQUEUE       2       /* preempted while runnable */
#define KIND_UNINTERRUPTIBLE 3      /* prev_state D */
#define KIND_OTHER          4
/* Off-CPU keys keep the system call the thread blocked in above the low
 * byte of kind: its number + 1, SYS_OUTSIDE when the thread was in none (a
 * page fault), 0 when it has no user registers (pytool/pyoffcpu/reasons.py). */
#define SYS_SHIFT           8
#define SYS_OUTSIDE         0xFFFF
/* ... and above that whether the thread held the GIL (on-CPU samples and
 * switch-outs of a registered Python process): */
#define GIL_SHIFT           24
#define GIL_UNKNOWN         0       /* not read (not a Python thread, no layout) */
#define GIL_FREE            1       /* another thread holds it, or nobody */
#define GIL_HELD            2       /* this thread holds it */
#define GIL_HELD_GC         3       /* ... and is in the cyclic collector (collecting) */
/* ... and above those, how a wait's time is counted (control.offcpu: the
 * sampled waits, docs/offcpu-sampling.md).  A key without either flag holds
 * waits whose stacks were all taken, at their exact durations. */
#define KIND_SAMPLED        0x4000000     /* stacks of waits shorter than the period, taken with
                                           probability d/T: the weight is T each, a share of
                                           their thread's KIND_SHORT total for that kind */
#define KIND_SHORT          0x8000000     /* no stack: the exact total of a thread's waits shorter
                                           than the period, per kind (count: how many) */
#define KIND_SHADOW         0x10000000    /* OFFCPU_SHADOW (tests): the sampled path's key, kept
                                           apart from the exact one of the same waits */
#define KIND_FLAGS          0x1c000000 /* all three */

struct stack_key {
    unsigned int tgid;
    unsigned int tid;
    int ustack;                     /* stack id in ustacks, < 0: none (-errno) */
    int kstack;                     /* stack id in kstacks, < 0: none */
    unsigned long long pystack;     /* hash of the Python stack, 0: none */
    unsigned int kind;
    unsigned int gen;               /* drain generation (control.gen when added) */
    unsigned long long nstack;      /* hash of the native stack in nstacks (bpf/unwind.c),
                                       0: none (ustack holds the frame-pointer stack) */
};

struct stack_value {
    unsigned long long count;       /* events: samples or switch-outs */
    unsigned long long ns;          /* wall time */
};

/* One per session, written by user space.  Nothing is recorded before
 * start_ns is set or from end_ns on, and every interval is clamped to
 * [start_ns, end_ns): the recording window is exact.  `gen` flips at each
 * drain: user space takes the keys of the old generation, which BPF no longer
 * touches, so nothing is added to an entry while it is being read. */
#define MAX_INLINE_TARGETS 8
#define TARGETS_IN_MAP 0xffffffff   /* ntargets: more than fit inline, look in procs */
struct control_t {
    unsigned long long start_ns;    /* bpf_ktime_get_ns() / CLOCK_MONOTONIC */
    unsigned long long end_ns;      /* 0: still recording */
    unsigned int gen;
    unsigned int ntargets;
    unsigned int targets[MAX_INLINE_TARGETS];   /* target tgids: no hash lookup for bystanders */
    unsigned int discover;          /* -a with filters: report every exec, target or not */
    unsigned int self_tgid;         /* pyoffcpu: never a target, even under SYSTEM_WIDE */
    unsigned int follow;            /* --subprocesses: a target's new process is one too */
    unsigned int pad;
    unsigned long long min_block_ns;    /* --min-block-us: shorter waits are left out */
    unsigned long long max_block_ns;    /* --max-block-us (0: none): longer ones too */
    unsigned int fold;              /* FOLD_*: ended threads folded here (fold_exit) */
    unsigned int offcpu;            /* OFFCPU_*: where a wait's stack is taken */
    unsigned long long timeline_min_ns; /* --timeline: the shortest wait sent (user space raises it) */
};
/* control.offcpu.  OFFCPU_EXACT: a stack at every switch-out, as the thread
 * leaves the CPU.  OFFCPU_SAMPLED: the switch-out keeps the wait's kind and
 * time only; at its switch-in a wait of d >= T (the sampling period) is owed
 * a stack at weight d, a shorter one with probability d/T at weight T (its
 * time goes to its thread's KIND_SHORT total all the same), and the stack is
 * taken in the thread's own context on its way back to user space
 * (rseq_update: the user stack has not changed since it blocked).  A thread
 * without rseq is captured at its switch-outs.  OFFCPU_SHADOW (tests): both,
 * the sampled path's keys marked KIND_SHADOW. */
#define OFFCPU_EXACT    0
#define OFFCPU_SAMPLED  1
#define OFFCPU_SHADOW   2

/* Threads born during the recording that end in it, folded in the kernel
 * at their last switch (fold_exit), into one group per process, entry stack
 * and name; user space reads groups, not threads (it folds the same way the
 * threads the kernel does not: see pytool/pyoffcpu/collect/accounting.py).
 * Until it ends, a thread's keys (gen GEN_HELD) and their times are kept in
 * its held_keys entry, not in agg (a key there cost four map operations
 * more: made, looked up, looked up at the fold and deleted), MAX_HELD at
 * most: one more and it is left to user space, as is one whose times are
 * too long for the kernel's 64-bit scaling (FOLD_SCALE_MAX).  User space
 * reads the entries of the threads still there at the end. */
#define FOLD_WALL       1           /* fold, on-CPU keys scaled to the exact on-CPU time */
#define FOLD_OFFCPU     2           /* fold, --mode off: no on-CPU time */
#define FOLD_SHADOW     4           /* tests: the threads are also left to user space */
#define FOLD_MODE_MASK  3
#define GEN_HELD        2           /* stack_key.gen of a key its live thread holds */
#define MAX_HELD        32          /* power of two */
#define HELD_SLOTS      64          /* held_t.slot: twice MAX_HELD, a power of two */
#define HELD_PROBES     8           /* a key is looked for in this many slots from its hash's */
#define GROUP_TID       0x80000000U /* stack_key.tid of a group's key: | its id */
#define FOLD_SCALE_MAX  (1ULL << 32)
#define USTACK_UNSAMPLED (-1000)    /* stack_key.ustack: on-CPU time no sample landed in */
#define USTACK_NO_STACK  (-1001)    /* ... time whose stack is not known */
#define USTACK_SHORT     (-1002)    /* ... a KIND_SHORT total (waits shorter than the period) */
#define STACK_ENTRY     1           /* stack_class: the stack names an entry function */
#define STACK_NO_ENTRY  2           /* ... it does not (threading's frames only) */
struct held_t {
    unsigned int n;                 /* keys listed */
    unsigned int overflow;          /* a key did not fit: user space folds this thread */
    struct stack_key keys[MAX_HELD];    /* in the order they were made */
    struct stack_value vals[MAX_HELD];  /* ... and their times */
    unsigned char slot[HELD_SLOTS]; /* an index: 1 + a key's place in keys, at its hash (0: free) */
};
/* A group: a process, the Python stack its threads spent the most time in
 * (0: none), their name. */
struct group_id_key {
    unsigned int tgid;
    unsigned int pad;
    unsigned long long pystack;
    unsigned long long comm0, comm1;
};
/* A group's folded threads, per drain generation and CPU (one writer each). */
struct group_key {
    unsigned int id, gen, cpu, pad;
};
struct group_t {
    unsigned long long threads;
    unsigned long long on_ns;       /* their exact on-CPU time (FOLD_WALL) */
    unsigned long long samples;     /* their on-CPU samples */
    unsigned long long first_ts;    /* the earliest first switch of one of them */
    unsigned long long last_ts;     /* the latest last switch */
    unsigned long long first_tid;   /* the thread of first_ts */
};

/* Per thread of a target: its exact on-CPU time, from its switch-in and
 * switch-out timestamps, and where it is in its life.  Created by user space
 * for the threads there at the start, by sched_process_fork for new ones. */
#define TH_BORN       1             /* created during the recording */
#define TH_EXITED     2             /* its last switch-out (TASK_DEAD) was seen */
#define TH_ON         4             /* on a CPU since ts */
#define TH_OFF        8             /* off the CPU since ts (switched out in the window) */
#define TH_FIRST_IN   16            /* its first event in the window was a switch-in */
#define TH_FIRST_OUT  32            /* ... a switch-out: it was running at the start */
#define TH_HELD       64            /* its keys are held for the kernel's fold (held_keys) */
#define TH_KFOLDED    128           /* FOLD_SHADOW: the kernel folded it too */
#define TH_CAPTURED   256           /* its open wait's stack was taken at the switch-out
                                       (offcpu_start holds it) */
#define TH_PENDING    512           /* a stack is owed for its last wait (pend_*) */
#define TH_RSEQ       1024          /* checked: it has rseq (rseq_update fires for it) */
#define TH_NO_RSEQ    2048          /* ... it has none, or went back to user space without
                                       rseq_update: its waits are captured at their switch-outs */
#define TH_EXITING    4096          /* it began to exit at exit_ts (sched_process_exit, every
                                       thread's): its end in cpu mode, where no switch is seen,
                                       and the bound of one whose last switch-out BPF missed */
#define SHORT_SLOTS   4             /* a thread's KIND_SHORT totals kept in its entry: a power of two */
#define SHORT_SLOTS_LOG2 2
struct thread_t {
    unsigned int tgid;
    unsigned int flags;
    unsigned long long on_ns;       /* on-CPU time inside the window, closed spans */
    unsigned long long off_ns;      /* off-CPU time BPF added to agg */
    unsigned long long ts;          /* its last switch */
    unsigned long long first_ts;    /* its first switch in the window, 0: none yet */
    unsigned long long last_ts;     /* TH_EXITED: its last switch-out */
    unsigned long long exec_ns;     /* its se.sum_exec_runtime at its last switch */
    unsigned long long unseen_ns;   /* off-CPU time after a switch-out BPF did not see */
    char comm[16];
    /* OFFCPU_SAMPLED: the open wait (TH_OFF) and the stack owed (TH_PENDING) */
    unsigned int wait_kind;         /* its kind (state, system call) at the switch-out */
    int wait_kstack;                /* --kernel: its kernel stack, taken there */
    unsigned int pend_kind;         /* the owed capture's key kind (KIND_SAMPLED or not) */
    int pend_kstack;
    unsigned long long pend_ns;     /* its weight */
    unsigned long long pend_from;   /* the wait's start (--wakers: a waker after it woke it) */
    /* its KIND_SHORT totals not in agg yet, one slot per kind (short_n 0:
     * free): added when a kind finds no slot free, past SHORT_FLUSH_NS, at
     * its end, and by user space at the end of the recording */
    unsigned int short_kind[SHORT_SLOTS];
    unsigned int short_n[SHORT_SLOTS];  /* how many waits */
    unsigned long long short_ns[SHORT_SLOTS];
    unsigned int pend_rounds;       /* switch-outs the owed capture was kept over (still in
                                       the kernel since its wait); MAX_PEND_ROUNDS at most */
    unsigned int pend_pad;
    unsigned long long exit_ts;     /* TH_EXITING: when */
};
#define MAX_PEND_ROUNDS 32
#define SHORT_FLUSH_NS  100000000   /* 100 ms: a live view lags no more than that per slot */

struct offcpu_start {
    struct stack_key key;
    unsigned long long ts;
};

/* --timeline (TIMELINE): one wait of at least control.timeline_min_ns as it
 * ends (its stack taken at its switch-out: OFFCPU_EXACT), or one on-CPU
 * sample, sent to user space whole (the `timeline` perf buffer) with its
 * stack key, which the drains resolve as agg's. */
struct timeline_event {
    struct stack_key key;
    unsigned long long begin;       /* bpf_ktime_get_ns: the wait's switch-out; the sample's time */
    unsigned long long end;         /* the wait's switch-in; 0: an on-CPU sample */
    unsigned long long wake_ts;     /* --wakers: when a thread woke the wait (0: not known) */
    unsigned int waker_tgid, waker_tid;
    char comm[16];                  /* the thread's name */
};

/* A Python stack user space read for a thread that blocked before its
 * process was registered with its interpreter (BPF walked no Python frames
 * then): the stack of that off-CPU interval exactly, as long as it is the
 * same interval (ts), since the thread has not run in between. */
struct pystack_fix {
    unsigned long long ts;          /* offcpu_start.ts of the interval */
    unsigned long long pystack;     /* hash of the stack user space sent */
};

/* --wakers: who ended a target thread's wait.  sched_waking runs in the
 * waker's context, unless the wakeup comes from an interrupt (a timer's
 * expiry: a sleep or a timeout; a device or a softirq), where `current` is
 * whatever it interrupted: those are WAKER_TIMER / WAKER_IRQ, no thread. */
#define WAKER_NONE   0              /* not known (no wakeup seen after the wait began) */
#define WAKER_TASK   1
#define WAKER_TIMER  2
#define WAKER_IRQ    3
struct waker_t {
    unsigned long long ts;          /* when it woke the thread */
    unsigned long long pystack;     /* the waker's Python stack (a registered target), 0: none */
    unsigned long long nstack;      /* its native stack (nstacks), 0: none */
    unsigned long long comm[2];     /* its name (bpf_get_current_comm), as two words */
    unsigned int kind;              /* WAKER_* */
    unsigned int tgid, tid;         /* the waker (WAKER_TASK) */
    int ustack, kstack;             /* its frame-pointer and kernel stack ids, < 0: none */
    unsigned int pad;
};
/* One wait's wakee and waker, aggregated (wake_agg) in wall and off mode.
 * The first fields are the wait's stack_key, field for field (its time in
 * agg is the same wait's: user space splits it by waker); flat, so that
 * user space unpacks it as it does agg's keys. */
struct wake_key {
    unsigned int tgid, tid;         /* the thread that waited */
    int ustack, kstack;
    unsigned long long pystack;
    unsigned int kind;              /* its stack_key.kind (the state, the system call) */
    unsigned int gen;               /* drain generation, as stack_key.gen */
    unsigned long long nstack;
    unsigned int waker_kind;
    unsigned int waker_tgid, waker_tid;
    int waker_ustack, waker_kstack;
    unsigned int waker_pad;
    unsigned long long waker_pystack;
    unsigned long long waker_nstack;
    unsigned long long waker_comm0, waker_comm1;
};

/* Indexes of the drops counter array. */
#define DROP_USTACK        0        /* user stack: bpf_get_stackid(user) failed */
#define DROP_KSTACK        1        /* kernel stack: bpf_get_stackid(kernel) failed */
#define DROP_PY_READ       2        /* python read: a CPython structure could not be read */
#define DROP_PY_TRUNCATED  3        /* python truncated: a Python stack deeper than MAX_PY_DEPTH */
#define DROP_AGG_FULL      4        /* aggregation map full: time lost */
#define DROP_START_FULL    5        /* off-cpu start map full: a blocked interval's stack lost */
#define DROP_PYSTACK_FULL  6        /* python stack map full: the stack is re-sent each time */
#define DROP_NSTACK_FULL   7        /* native stack map full: a native stack lost */
#define DROP_NSTACK_INCOMPLETE 8    /* native stack incomplete: stopped at a frame it could not unwind */
#define DROP_THREADS_FULL  9        /* thread map full: a thread's exact times lost */
#define DROP_MEMO_FULL     10       /* switch memo map full: a thread's captures not reused */
#define DROP_NO_THREAD     11       /* unknown thread: a target thread switched in with no entry */
#define DROP_IN_UNSEEN     12       /* switch-in not seen: recovered exactly from the kernel's runtime */
#define DROP_OUT_UNSEEN    13       /* switch-out not seen: times recovered, the stack of the wait lost */
#define DROP_CAPTURE_LOST  14       /* wait stack not taken: the thread returned to user space without rseq_update (then captured at its switch-outs) */
#define DROP_IN_LATE       15       /* switch-in not seen, its wait's stack taken on the way back to user space */
#define N_DROPS            16
/* drops_ns holds the time lost for the drops that lose time: DROP_AGG_FULL
 * (the weight that could not be added), DROP_START_FULL (the blocked
 * interval whose start could not be kept, known from thread_t.ts),
 * DROP_CAPTURE_LOST (the weight kept without a stack). */

#endif
