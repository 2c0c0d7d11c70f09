/* Values set at load time, not compiled in: what depends on the kernel (the
 * offsets of task_struct, pt_regs and the file structs, from its BTF; what
 * sched_process_exit passes) and on the session (the sampling period).  The
 * compiled programs are then the same on every kernel: the cache serves a
 * new kernel without a compile, and a build can ship them.
 *
 * Each is a 64-bit load of LOADCONST_MAGIC + its index (LC_*) that the
 * compiler keeps as it is (an asm statement); the compile records where each
 * one is, and the loader writes the value in before the verifier sees the
 * program (collect/progcache.py, collect/bpfload.py), which then knows it
 * as a constant, as it knew a -D one.  A -DNAME=value still wins. */
#ifndef PYOFFCPU_LOADCONST_H
#define PYOFFCPU_LOADCONST_H

#define LOADCONST_MAGIC      0x50794f4600000000   /* "PyOF", then the index */
#define LOADCONST_INDEX_MASK 0xffff

#define LC_TASK_FSBASE_OFF      1   /* offsetof(task_struct, thread.fsbase) */
#define LC_TASK_PID_OFF         2
#define LC_TASK_TGID_OFF        3
#define LC_TASK_EXEC_OFF        4   /* ... of the exec'd file's identity (switch.c) */
#define LC_TASK_RSEQ_OFF        5   /* -1: none */
#define LC_TASK_LEADER_OFF      6
#define LC_TASK_START_OFF       7
#define LC_EXIT_GROUP_DEAD      8   /* sched_process_exit passes group_dead */
#define LC_SAMPLE_PERIOD_NS     9
#define LC_SYS_REGS_AX_OFF      10  /* pt_regs: the system call's return, number, cs */
#define LC_SYS_REGS_ORIG_AX_OFF 11
#define LC_SYS_REGS_CS_OFF      12
#define LC_PT_REGS_IP_OFF       13  /* pt_regs, for the native unwinder and crashes */
#define LC_PT_REGS_SP_OFF       14
#define LC_PT_REGS_BP_OFF       15
#define LC_PT_REGS_BX_OFF       16
#define LC_PT_REGS_CS_OFF       17
#define LC_PT_REGS_SIZE         18
#define LC_BPRM_FILE_OFF        19  /* the crash watcher's program-file identity */
#define LC_FILE_INODE_OFF       20
#define LC_INODE_INO_OFF        21
#define LC_INODE_SB_OFF         22
#define LC_INODE_GEN_OFF        23
#define LC_SB_DEV_OFF           24
/* What the session turns on (1) or off (0); the verifier follows only the
 * branch a value takes, so a feature that is off costs it nothing. */
#define LC_KERNEL_STACKS        25  /* capture kernel stacks */
#define LC_SYSTEM_WIDE          26  /* every process, not only those in `procs` */
#define LC_WAKERS               27  /* --wakers */
#define LC_ASYNC_TASKS          28  /* --async */
#define LC_TIMELINE             29  /* --timeline */
#define LC_NATIVE_UNWIND        30  /* .eh_frame tables (bpf/unwind.c); 0: frame pointers */
/* Direct reads of kernel structs (task_u32 below) */
#define LC_KERNEL_CAST          31  /* 1: the loader made each KFUNC_RDONLY_CAST call bpf_rdonly_cast */
#define LC_BTF_TASK_STRUCT      32  /* task_struct's type id in the kernel's BTF (with KERNEL_CAST) */

#define LOAD_CONST(i) ({ unsigned long long __lc;                                  \
        asm volatile("%0 = %1 ll" : "=r"(__lc) : "i"(LOADCONST_MAGIC + (i)));     \
        __lc; })

#ifndef TASK_FSBASE_OFF
#define TASK_FSBASE_OFF LOAD_CONST(LC_TASK_FSBASE_OFF)
#endif
#ifndef TASK_PID_OFF
#define TASK_PID_OFF LOAD_CONST(LC_TASK_PID_OFF)
#endif
#ifndef TASK_TGID_OFF
#define TASK_TGID_OFF LOAD_CONST(LC_TASK_TGID_OFF)
#endif
#ifndef TASK_EXEC_OFF
#define TASK_EXEC_OFF LOAD_CONST(LC_TASK_EXEC_OFF)
#endif
#ifndef TASK_RSEQ_OFF
#define TASK_RSEQ_OFF ((long long)LOAD_CONST(LC_TASK_RSEQ_OFF))
#endif
#ifndef TASK_LEADER_OFF
#define TASK_LEADER_OFF LOAD_CONST(LC_TASK_LEADER_OFF)
#endif
#ifndef TASK_START_OFF
#define TASK_START_OFF LOAD_CONST(LC_TASK_START_OFF)
#endif
#ifndef EXIT_GROUP_DEAD
#define EXIT_GROUP_DEAD LOAD_CONST(LC_EXIT_GROUP_DEAD)
#endif
#ifndef SAMPLE_PERIOD_NS
#define SAMPLE_PERIOD_NS LOAD_CONST(LC_SAMPLE_PERIOD_NS)
#endif
#ifndef SYS_REGS_AX_OFF
#define SYS_REGS_AX_OFF LOAD_CONST(LC_SYS_REGS_AX_OFF)
#define SYS_REGS_ORIG_AX_OFF LOAD_CONST(LC_SYS_REGS_ORIG_AX_OFF)
#define SYS_REGS_CS_OFF LOAD_CONST(LC_SYS_REGS_CS_OFF)
#endif
#ifndef PT_REGS_IP_OFF
#define PT_REGS_IP_OFF LOAD_CONST(LC_PT_REGS_IP_OFF)
#define PT_REGS_SP_OFF LOAD_CONST(LC_PT_REGS_SP_OFF)
#define PT_REGS_BP_OFF LOAD_CONST(LC_PT_REGS_BP_OFF)
#define PT_REGS_BX_OFF LOAD_CONST(LC_PT_REGS_BX_OFF)
#define PT_REGS_CS_OFF LOAD_CONST(LC_PT_REGS_CS_OFF)
#endif
#ifndef PT_REGS_SIZE
#define PT_REGS_SIZE LOAD_CONST(LC_PT_REGS_SIZE)
#endif
#ifndef BPRM_FILE_OFF
#define BPRM_FILE_OFF LOAD_CONST(LC_BPRM_FILE_OFF)
#define FILE_INODE_OFF LOAD_CONST(LC_FILE_INODE_OFF)
#define INODE_INO_OFF LOAD_CONST(LC_INODE_INO_OFF)
#define INODE_SB_OFF LOAD_CONST(LC_INODE_SB_OFF)
#define INODE_GEN_OFF LOAD_CONST(LC_INODE_GEN_OFF)
#define SB_DEV_OFF LOAD_CONST(LC_SB_DEV_OFF)
#endif
#ifndef KERNEL_STACKS
#define KERNEL_STACKS LOAD_CONST(LC_KERNEL_STACKS)
#endif
#ifndef SYSTEM_WIDE
#define SYSTEM_WIDE LOAD_CONST(LC_SYSTEM_WIDE)
#endif
#ifndef WAKERS
#define WAKERS LOAD_CONST(LC_WAKERS)
#endif
#ifndef ASYNC_TASKS
#define ASYNC_TASKS LOAD_CONST(LC_ASYNC_TASKS)
#endif
#ifndef TIMELINE
#define TIMELINE LOAD_CONST(LC_TIMELINE)
#endif
#ifndef NATIVE_UNWIND
#define NATIVE_UNWIND LOAD_CONST(LC_NATIVE_UNWIND)
#endif
#ifndef KERNEL_CAST
#define KERNEL_CAST LOAD_CONST(LC_KERNEL_CAST)
#define BTF_TASK_STRUCT LOAD_CONST(LC_BTF_TASK_STRUCT)
#endif

/* A field of a task_struct (task: its address, off: the field's offset, a
 * load-time constant).  Where the kernel has the bpf_rdonly_cast kfunc, the
 * loader turns each call of KFUNC_RDONLY_CAST, a helper id no kernel has,
 * into a call of it, and sets KERNEL_CAST: the field is then one load, which
 * the verifier checks against task_struct's BTF and the JIT guards (a fault
 * reads 0), not a bpf_probe_read_kernel call (~50 ns less per read, on a
 * path every switch on the machine takes).  Elsewhere KERNEL_CAST is 0, the
 * verifier never walks the cast, and the helper reads it. */
#define KFUNC_RDONLY_CAST 0x50794601
#ifndef PYOFFCPU_USER_SPACE     /* BPF code: not for the C helper that shares the constants */
static void *(*kfunc_rdonly_cast)(unsigned long long obj, unsigned int btf_id) = (void *)KFUNC_RDONLY_CAST;

static __always_inline unsigned int task_u32(unsigned long long task, unsigned long long off)
{
    if (KERNEL_CAST) {
        char *t = kfunc_rdonly_cast(task, BTF_TASK_STRUCT);
        return *(volatile unsigned int *)(t + off);
    }
    unsigned int v = 0;
    bpf_probe_read_kernel(&v, sizeof(v), (void *)(task + off));
    return v;
}

static __always_inline unsigned long long task_u64(unsigned long long task, unsigned long long off)
{
    if (KERNEL_CAST) {
        char *t = kfunc_rdonly_cast(task, BTF_TASK_STRUCT);
        return *(volatile unsigned long long *)(t + off);
    }
    unsigned long long v = 0;
    bpf_probe_read_kernel(&v, sizeof(v), (void *)(task + off));
    return v;
}
#endif

#endif
