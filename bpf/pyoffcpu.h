/* Structs shared by the BPF programs (pyoffcpu.bpf.c) and the loader
 * (pytool/pyoffcpu/bpfmaps.py mirrors them with ctypes: keep both in step). */
#ifndef PYOFFCPU_H
#define PYOFFCPU_H

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

/* pystack.flags */
#define PYS_TRUNCATED   1           /* more frames than MAX_PY_DEPTH: outermost lost */
#define PYS_READ_FAILED 2           /* a read failed part-way: the stack is partial */

/* Per target process: the offsets of its CPython (from offsets_table.py), the
 * pthread key of its tstate and the address of PyCode_Type.  -1 = absent. */
struct proc_info {
    int walker;
    int tss_key;                    /* autoTSSkey's pthread key */
    int tstate_frame;               /* <= 3.10 */
    int tstate_cframe;              /* 3.11 / 3.12 */
    int cframe_current_frame;
    int tstate_current_frame;       /* 3.13+ */
    int frame_back, frame_code, frame_lasti;
    int iframe_code, iframe_previous, iframe_instr, iframe_is_entry, iframe_owner;
    int code_code_adaptive;
};

struct py_frame {
    unsigned long long code;        /* PyCodeObject* */
    int offset;                     /* bytes into the bytecode (<= 3.10: f_lasti as stored) */
    unsigned int flags;
};

struct pystack {
    unsigned long long hash;        /* key of the stack in pystack_seen */
    unsigned int tgid;
    unsigned int depth;
    unsigned int flags;
    unsigned int pad;
    struct py_frame frames[MAX_PY_DEPTH];   /* innermost first */
};

/* What the time is for: on-CPU, or why a thread was off the CPU. */
#define KIND_ONCPU          0
#define KIND_SLEEP          1       /* prev_state S */
#define KIND_RUNQUEUE       2       /* preempted while runnable */
#define KIND_UNINTERRUPTIBLE 3      /* prev_state D */
#define KIND_OTHER          4

struct stack_key {
    unsigned int tgid;
    unsigned int tid;
    int ustack;                     /* stack id in ustacks, < 0: none (-errno) */
    int kstack;                     /* stack id in kstacks, < 0: none */
    unsigned long long pystack;     /* hash of the Python stack, 0: none */
    unsigned int kind;
    unsigned int pad;
    unsigned long long nstack;      /* hash of the native stack in nstacks (bpf/unwind.h),
                                       0: none (ustack holds the frame-pointer stack) */
};

struct stack_value {
    unsigned long long count;       /* events: samples or switch-outs */
    unsigned long long ns;          /* wall time */
};

struct comm_t {
    char c[16];
};

struct offcpu_start {
    struct stack_key key;
    unsigned long long ts;
};

/* Indexes of the drops counter array. */
#define DROP_USTACK        0        /* bpf_get_stackid(user) failed */
#define DROP_KSTACK        1        /* bpf_get_stackid(kernel) failed */
#define DROP_PY_READ       2        /* a CPython structure could not be read */
#define DROP_PY_TRUNCATED  3        /* a Python stack deeper than MAX_PY_DEPTH */
#define DROP_AGG_FULL      4        /* the aggregation map was full: time lost */
#define DROP_START_FULL    5        /* offcpu_start full: a blocked interval lost */
#define DROP_PYSTACK_FULL  6        /* pystack_seen full: stack re-sent each time */
#define DROP_NSTACK_FULL   7        /* nstacks full: a native stack lost */
#define DROP_NSTACK_INCOMPLETE 8    /* a native stack stopped at a frame it could not unwind */
#define N_DROPS            9

#endif
