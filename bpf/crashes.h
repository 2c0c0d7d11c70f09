/* Structs and constants shared by the crash watcher (crashes.bpf.c) and
 * its loader (pytool/pyoffcpu/collect/crashcapture.py), read there through
 * bpfdefs.py as pyoffcpu.h is: no second copy.
 *
 * One fatal signal is sent to user space as a few perf buffer records,
 * in this order, all from the CPU that delivered it: CR_MAIN (who, which
 * signal, the registers, the kernel stack), CR_STACK (the user stack's
 * bytes), for a registered Python process CR_PYSTACK (its frames) and one
 * CR_MEM per object its frames name, then CR_END.  Every record starts with
 * a crash_hdr; `id` (the delivery's ktime) and tid tie them together, since
 * another CPU's crash may interleave. */
#ifndef PYOFFCPU_CRASHES_H
#define PYOFFCPU_CRASHES_H

#define CR_MAIN     1
#define CR_STACK    2
#define CR_PYSTACK  3
#define CR_MEM      4
#define CR_END      5

#define CR_STACK_MAX   32768        /* user stack bytes copied from sp up */
#define CR_STACK_PAGES 9            /* a partial first page, then whole ones */
#define CR_MEM_MAX     16384        /* one object's bytes at most */
#define CR_CODE_MAX    512          /* a code object's span at most (crash_layout.code_span) */
#define CR_KSTACK      32           /* kernel frames */
#define CR_REGS_MAX    256          /* bytes of struct pt_regs copied at most */
#define CR_OBJS_PER_PROG 16         /* objects one run of crash_code copies; then it tail-calls itself */
#define CR_MAX_OTHERS  64           /* other threads' states looked at (a bound on the list) */

/* crash_end.flags, crash_main.flags */
#define CRF_NO_REGS      1          /* the thread has no user registers */
#define CRF_STACK_SHORT  2          /* the stack's copy ended before CR_STACK_MAX (its mapping ended) */
#define CRF_PY_CALL      4          /* the tail call into the Python walk failed */
#define CRF_CODE_CALL    8          /* a tail call of the object copier failed: objects left out */
#define CRF_MEM_FAILED   16         /* an object could not be read */
#define CRF_MEM_CUT      32         /* an object was larger than CR_MEM_MAX: cut */
#define CRF_OBJS_LEFT    64         /* the tail calls ran out: objects or other threads left out */
#define CRF_OTHERS_READ  128        /* the thread list could not be read: other threads left out */
#define CRF_LIGHT        256        /* over its user's budget of full captures: no stack copy */
#define CRF_PART_LOST    512        /* a record after CR_MAIN could not be sent (the buffer was full) */

/* Every crash signal that passed the filter, by what became of it: user
 * space sets reports beside these, so that no crash goes without a word. */
#define CRT_SEEN   0                /* signals that passed the filter */
#define CRT_LOST   1                /* CR_MAIN could not be sent: the perf buffer was full */
#define CRT_RATE   2                /* over its user's budget of captures a second: not captured */
#define CRT_LIGHT  3                /* over its user's budget of full captures: captured without
                                       the user stack's copy */
#define CRT_N      4

/* Per user, in the current second: a storm of one user's crashes (a
 * hundred workers dying at once) cannot fill the perf buffer for another
 * user's crash in the same second.  The first CR_FULL_PER_UID_S get the
 * stack's copy (32 KiB), up to CR_PER_UID_S more only the rest (CRF_LIGHT:
 * registers, kernel stack, Python frames and code objects); past that,
 * counted (CRT_RATE and `rate`) and not captured. */
#define CR_FULL_PER_UID_S 4
#define CR_PER_UID_S      160
struct uid_budget {
    unsigned long long window;      /* the second's start (ktime) */
    unsigned int full, all;         /* captures in it: with the stack, at all */
    unsigned long long rate;        /* crashes not captured (over the budget), all time */
    unsigned long long lost;        /* crashes whose CR_MAIN could not be sent, all time */
};

/* control: the filter, written by user space */
#define CR_ANY_UID 0xffffffff
struct crash_control {
    unsigned int uid;               /* CR_ANY_UID: every user */
    unsigned int only_watched;      /* 1: only the tgids in `watched` */
    unsigned int births;            /* 1: tell of births (and watch the new images) */
    unsigned int pad;
};

/* `watched` values: put there by the watcher, or by BPF at an exec (a new
 * image the watcher has not looked at yet: its crash is captured all the
 * same, and the watcher decides once it has read the process) */
#define CR_WATCHED       1
#define CR_WATCHED_NEW   2

/* What the watcher found a program file to be (exe_kinds, keyed by the
 * file): not CPython and never to become it (its execs are not told), or
 * one that is (or links libpython).  A file not there yet is told. */
#define CR_EXE_NATIVE    1
#define CR_EXE_PYTHON    2
struct exe_id {
    unsigned long long ino;
    unsigned int dev;               /* the kernel's dev_t: MAJOR << 20 | MINOR */
    unsigned int generation;        /* i_generation: a new file under a reused inode number */
};

/* A process born (CR_BIRTH_EXEC: an image exec'd; CR_BIRTH_FORK: a fork of
 * a process), told at once so the watcher reads it without waiting for
 * its next scan of /proc. */
#define CR_BIRTH_EXEC    1
#define CR_BIRTH_FORK    2
struct crash_birth {
    unsigned int kind;              /* CR_BIRTH_* */
    unsigned int pid;               /* the process (a fork's child) */
    unsigned int parent;            /* a fork's parent; 0 for an exec */
    unsigned int pad;
    unsigned long long ts;          /* bpf_ktime_get_ns() at the birth */
    struct exe_id exe;              /* an exec: its program's file */
};

/* Per registered Python process, next to its proc_info: where CodeReader
 * (pytool/pyoffcpu/cpython/code.py) reads a code object and the str and
 * bytes objects it points to, so that BPF copies exactly those bytes. */
struct crash_layout {
    int code_span;                  /* bytes of the code object CodeReader reads */
    int code_name;                  /* co_qualname (3.11+) or co_name */
    int code_filename, code_linetable;
    int unicode_length, unicode_state, ascii_data, compact_data;
    int bytes_size, bytes_data;
    /* the other threads: tstate->interp->threads.head, tstate->next, and
     * the thread's id: tstate->native_thread_id (3.8+), else through its
     * pthread (tstate->thread_id) at pthread_tid; -1: absent */
    int tstate_interp, interp_threads_head, tstate_next;
    int tstate_native_thread_id, tstate_thread_id, pthread_tid;
};

struct crash_hdr {
    unsigned long long id;          /* bpf_ktime_get_ns() at the delivery */
    unsigned int kind;              /* CR_* */
    unsigned int tgid, tid;
    unsigned int len;               /* bytes of data after the fixed part (CR_STACK, CR_MEM) */
};

struct crash_main {
    struct crash_hdr h;
    int sig, si_code;
    unsigned long long addr;        /* si_addr (faults); for other codes what lies there */
    unsigned long long handler;     /* sa_handler: 0 SIG_DFL, 1 SIG_IGN, else the handler */
    unsigned long long fsbase;
    unsigned int uid, flags;        /* CRF_* */
    unsigned int regs_len;          /* bytes of pt_regs in regs (0: none) */
    int kstack_len;                 /* bytes of kernel stack (bpf_get_stack), < 0: -errno */
    /* which process image this is, for user space to match its registration
     * against: the process's start (its leader's start_boottime, what
     * /proc/PID/stat's starttime counts in ticks: a reused PID differs) and
     * its execs since the watcher saw it first (`execs`) */
    unsigned long long start_ns;
    unsigned int execs, pad;
    char comm[16];
    unsigned char regs[CR_REGS_MAX];    /* struct pt_regs as saved at kernel entry */
    unsigned long long kstack[CR_KSTACK];
};

/* The user stack from sp: len bytes of data (sp .. sp + len). */
struct crash_stack {
    struct crash_hdr h;
    unsigned long long sp;
    unsigned char data[CR_STACK_MAX + 4096];    /* room for a page past a bounded offset */
};

/* A thread's Python frames: the crashing thread's first (thread == h.tid),
 * then the other threads' of its interpreter. */
struct crash_py {
    struct crash_hdr h;
    unsigned int thread;            /* the thread whose frames these are (0: not known) */
    unsigned int pad;
    unsigned long long tstate;
    struct pystack st;
};

/* len bytes of the target's memory at addr. */
struct crash_mem {
    struct crash_hdr h;
    unsigned long long addr;
    unsigned char data[CR_MEM_MAX];
};

struct crash_end {
    struct crash_hdr h;
    unsigned int flags;             /* CRF_* */
    unsigned int objects;           /* CR_MEM records sent */
};

/* Per CPU: the capture in progress, carried across the tail calls. */
struct crash_state {
    unsigned long long id;
    unsigned int tgid, tid;
    unsigned int flags, objects;
    unsigned int frame;             /* the next frame of the Python stack to take */
    unsigned int obj;               /* 0: its code object next; 1-3: name, filename, line table */
    unsigned long long ptrs[4];     /* the objects the current code object points to */
    unsigned long long self_ts;     /* the crashing thread's PyThreadState */
    unsigned long long next_ts;     /* the next other thread's, 0: none left */
    unsigned int others;            /* other threads' states looked at */
    unsigned int pad;
    struct crash_layout lay;
};

/* A copied object, per capture: copied once however many frames name it. */
struct crash_seen {
    unsigned long long id;
    unsigned long long addr;
};

#endif
