/* The crash watcher's view of process lives (included by crashes.bpf.c,
 * whose maps it uses): an exec drops the old image's registration and
 * tells the watcher of the new one (births) unless its program file is
 * known not to be Python; a fork of a registered process copies the
 * registration to the child; an exit drops what the process had. */

/* A process born: the watcher is told at once (births), instead of
 * finding it at its next scan of /proc.  With only_watched, it is watched
 * from here on (CR_WATCHED_NEW) until the watcher has read it. */
static __always_inline void born(void *ctx, struct crash_birth *b, u8 watch)
{
    int zero = 0;
    struct crash_control *ctl = control.lookup(&zero);
    if (!ctl || !ctl->births)
        return;
    if (ctl->uid != CR_ANY_UID && (u32)bpf_get_current_uid_gid() != ctl->uid)
        return;
    if (ctl->only_watched && watch)
        watched.update(&b->pid, &watch);
    b->ts = bpf_ktime_get_ns();
    births.perf_submit(ctx, b, sizeof(*b));
}

/* An exec: the old image's registration no longer holds; counted, for the
 * crash of the new image to say it.  The new image is told unless its
 * program file is known not to be Python (exe_kinds): a shell's loop of
 * tools costs a lookup each, not a record and a read of each process.
 * Args: (struct task_struct *p, pid_t old_pid, struct linux_binprm *bprm). */
RAW_TRACEPOINT_PROBE(sched_process_exec)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (procs.lookup(&tgid)) {      /* a lookup takes no lock; most execs are no target's */
        procs.delete(&tgid);
        layouts.delete(&tgid);
    }
    u64 *n = execs.lookup(&tgid);
    if (n) {
        __sync_fetch_and_add(n, 1);
    } else {
        u64 one = 1;
        execs.update(&tgid, &one);
    }
    u64 file = 0, inode = 0, sb = 0;
    struct crash_birth b = {};
    bpf_probe_read_kernel(&file, sizeof(file), (void *)(ctx->args[2] + BPRM_FILE_OFF));
    if (file)
        bpf_probe_read_kernel(&inode, sizeof(inode), (void *)(file + FILE_INODE_OFF));
    if (inode) {
        bpf_probe_read_kernel(&b.exe.ino, sizeof(b.exe.ino), (void *)(inode + INODE_INO_OFF));
        bpf_probe_read_kernel(&b.exe.generation, sizeof(b.exe.generation),
                              (void *)(inode + INODE_GEN_OFF));
        bpf_probe_read_kernel(&sb, sizeof(sb), (void *)(inode + INODE_SB_OFF));
    }
    if (sb)
        bpf_probe_read_kernel(&b.exe.dev, sizeof(b.exe.dev), (void *)(sb + SB_DEV_OFF));
    u8 *kind = exe_kinds.lookup(&b.exe);
    if (kind && *kind == CR_EXE_NATIVE)
        return 0;
    u8 *was = watched.lookup(&tgid);
    b.kind = CR_BIRTH_EXEC;
    b.pid = tgid;
    born(ctx, &b, was ? *was : CR_WATCHED_NEW);
    return 0;
}

/* A fork of a registered Python process: the child is a copy of its image
 * (the same interpreter at the same addresses), so it gets the parent's
 * registration and its place among the watched before its first
 * instruction.  A fork of a watched process not registered yet (its
 * interpreter still starting) is told too, for the watcher to read.
 * Other forks (and threads: clone with CLONE_THREAD) are not births: an
 * exec tells of what they become. */
RAW_TRACEPOINT_PROBE(sched_process_fork)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    struct proc_info *pi = procs.lookup(&tgid);
    u8 watch = 0;
    u8 *was = watched.lookup(&tgid);
    if (was)
        watch = *was;
    if (!pi && !watch)
        return 0;
    u64 child = ctx->args[1];
    u32 ctgid = 0, ctid = 0;
    bpf_probe_read_kernel(&ctgid, sizeof(ctgid), (void *)(child + TASK_TGID_OFF));
    bpf_probe_read_kernel(&ctid, sizeof(ctid), (void *)(child + TASK_PID_OFF));
    if (ctid == 0 || ctgid != ctid)
        return 0;
    if (pi) {
        struct crash_layout *cl = layouts.lookup(&tgid);
        if (cl) {
            layouts.update(&ctgid, cl);
            procs.update(&ctgid, pi);
        }
    }
    struct crash_birth b = {};
    b.kind = CR_BIRTH_FORK;
    b.pid = ctgid;
    b.parent = tgid;
    /* watched as a new image (whatever its parent's entry): the watcher's
     * rewrite of the filter, which drops the entries it did not put there
     * as CR_WATCHED, must not drop it before the watcher has read it */
    born(ctx, &b, watch ? CR_WATCHED_NEW : 0);
    return 0;
}

/* A process's end: its registration and its place among the watched go
 * with it (the PID may be reused by a process no one selected). */
RAW_TRACEPOINT_PROBE(sched_process_exit)
{
    if (!last_thread_exits(ctx))
        return 0;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (procs.lookup(&tgid)) {
        procs.delete(&tgid);
        layouts.delete(&tgid);
    }
    execs.delete(&tgid);
    if (watched.lookup(&tgid))
        watched.delete(&tgid);
    return 0;
}
