"""Reference points for case 4: what any BPF program on sched_switch costs.

    python floor.py tp-empty | raw-filter | raw-empty-pair

tp-empty    an empty program on the sched:sched_switch tracepoint, attached the
            way pyoffcpu attaches its own (bcc TRACEPOINT_PROBE: a perf-event
            tracepoint, which formats the trace record before the program runs)
raw-filter  a raw tracepoint (BPF_RAW_TRACEPOINT_OPEN: no record formatted)
            doing what pyoffcpu's program does for a switch of two threads it
            does not profile: look the incoming thread up in a hash, look the
            outgoing process up in another
raw-empty-pair  empty programs on the two raw tracepoints pyoffcpu's wall mode
            runs at every switch (sched_switch, and rseq_update on the way back
            to user space): the floor of "BPF ns per switch" as the bench sums
            it, what two programs cost before they do anything

Prints `floor: attached` on stderr once attached, runs until SIGINT/SIGTERM.
"""
import signal
import sys
import time

from bcc import BPF

TP_EMPTY = r"""
TRACEPOINT_PROBE(sched, sched_switch)
{
    return 0;
}
"""

RAW_FILTER = r"""
BPF_HASH(procs, u32, u64, 4096);
BPF_HASH(offcpu_start, u32, u64, 65536);

RAW_TRACEPOINT_PROBE(sched_switch)
{
    /* args: (bool preempt, struct task_struct *prev, struct task_struct *next) */
    u32 next = (u32)ctx->args[2];             /* stands for next->pid: a key that varies */
    u64 *st = offcpu_start.lookup(&next);     /* the incoming thread's open interval */
    if (st)
        return 0;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (procs.lookup(&tgid))                  /* is the outgoing thread a target? */
        return 0;
    return 0;
}
"""

RAW_EMPTY_PAIR = r"""
RAW_TRACEPOINT_PROBE(sched_switch)
{
    return 0;
}

int rseq_capture(struct bpf_raw_tracepoint_args *ctx)     /* pyoffcpu's name: the bench adds it */
{
    return 0;
}
"""


def main():
    kind = sys.argv[1]
    src = {"tp-empty": TP_EMPTY, "raw-filter": RAW_FILTER, "raw-empty-pair": RAW_EMPTY_PAIR}[kind]
    b = BPF(text=src)
    if kind == "raw-empty-pair":
        b.attach_raw_tracepoint(tp="rseq_update", fn_name="rseq_capture")
    stop = []
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    print("floor: attached", file=sys.stderr, flush=True)
    while not stop:
        time.sleep(0.05)
    b.cleanup()


if __name__ == "__main__":
    main()
