"""The off-CPU rules table (reasons.py): one case per rule, the order they
are tried in, and the kind encoding BPF and /proc share with it."""
import pytest

from pyoffcpu.kernel import bpfdefs, syscalls
from pyoffcpu.profile import reasons
from pyoffcpu.profile.model import Frame, FrameKind, native_frame, python_frame

S, D, R, OTHER = (bpfdefs.KIND_SLEEP, bpfdefs.KIND_UNINTERRUPTIBLE, bpfdefs.KIND_RUNQUEUE,
                  bpfdefs.KIND_OTHER)
MAIN = python_frame("main", "app.py", 3)
LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"
CUDA = "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
PY = "/usr/lib/libpython3.12.so.1.0"
GOMP = "/venv/lib/python3.11/site-packages/torch/lib/libgomp.so.1"


def stack(*natives, kernel=()):
    """Root first, as the merger gives them: Python, then native, then kernel."""
    return [MAIN] + [native_frame(n, m) for n, m in natives] + [
        Frame(FrameKind.KERNEL, k) for k in kernel]


CASES = [
    # (reason, rule it comes from, kind, system call, frames)
    ("runqueue", "preempted", R, 202, stack(("take_gil", PY))),
    ("gpu", "ioctl under libcuda", S, 16, stack(("cuCtxSynchronize", CUDA), ("ioctl", LIBC))),
    ("gpu", "poll under libcudart", S, 7,
     stack(("cudaDeviceSynchronize", "/opt/cuda/libcudart.so.12"), ("poll", LIBC))),
    ("gil", "take_gil", S, 202, stack(("PyEval_RestoreThread", PY), ("take_gil", PY),
                                      ("pthread_cond_timedwait", LIBC))),
    ("gil", "PyGILState_Ensure", S, 202, stack(("PyGILState_Ensure", PY))),
    ("gil", "an LTO clone of take_gil (Debian's 3.11)", S, 202,
     stack(("take_gil.lto_priv.0", PY), ("pthread_cond_timedwait", LIBC))),
    ("gil", "drop_gil waiting for the switch (FORCE_SWITCHING)", S, 202, stack(("drop_gil", PY))),
    ("sleep", "pysleep before 3.11 (select)", S, 23, stack(("pysleep", PY), ("select", LIBC))),
    ("sleep", "clock_nanosleep", S, 230, stack(("clock_nanosleep", LIBC))),
    ("sleep", "nanosleep", S, 35, stack()),
    ("omp", "futex in torch's bundled, stripped libgomp", S, 202,
     stack(("GOMP_parallel", GOMP), ("libgomp.so.1@0x1de20", GOMP))),
    ("omp", "LLVM libomp's wait through the C library", S, 202,
     stack(("__kmp_suspend_64", "/usr/lib/x86_64-linux-gnu/libomp.so.5"), ("pthread_cond_wait", LIBC))),
    ("lock", "futex in the C library under code that is not OpenMP's", S, 202,
     stack(("GOMP_parallel", GOMP), ("worker_fn", "/app/libwork.so"), ("pthread_mutex_lock", LIBC))),
    ("lock", "futex", S, 202, stack(("PyThread_acquire_lock_timed", PY), ("sem_clockwait", LIBC))),
    ("lock", "futex uninterruptible is still a lock", D, 202, stack()),
    ("poll", "epoll_wait", S, 232, stack(("epoll_wait", LIBC))),
    ("poll", "select", S, 23, stack(("select", LIBC))),
    ("io", "read", S, 0, stack(("read", LIBC))),
    ("io", "recvfrom", S, 45, stack()),
    ("io", "fsync", D, 74, stack()),
    ("page-fault", "asleep in no system call", D, None, stack(("memcpy", LIBC))),
    ("disk", "D in another call", D, 257, stack()),
    ("other", "wait4", S, 61, stack()),
    ("other", "stopped", OTHER, None, stack()),
    ("other", "no user registers", S, syscalls.UNKNOWN, stack()),
    ("other", "ioctl not under a GPU library", S, 16, stack(("ioctl", LIBC))),
]


@pytest.mark.parametrize("reason,what,kind,sys,frames", CASES, ids=[c[1] for c in CASES])
def test_rule(reason, what, kind, sys, frames):
    assert reasons.classify(kind, sys, frames) == reason


def test_every_rule_and_reason_has_a_case():
    covered = {c[0] for c in CASES}
    assert covered == set(reasons.REASONS), set(reasons.REASONS) - covered
    for rule in reasons.RULES:
        assert any(reasons.classify(k, s, f) == rule.reason and rule.matches(
            reasons.Wait(k, s, [x for x in f if x.kind is FrameKind.NATIVE][::-1]))
            for _, _, k, s, f in CASES), rule.says


def test_kernel_frames_never_decide():
    """The same wait with and without --kernel: the same reason."""
    for reason, _, kind, sys, frames in CASES:
        with_kernel = frames + [Frame(FrameKind.KERNEL, "take_gil"),
                                Frame(FrameKind.KERNEL, "futex_wait_queue")]
        assert reasons.classify(kind, sys, with_kernel) == reason


@pytest.mark.parametrize("sys", [None, syscalls.UNKNOWN, 0, 202, 449])
def test_kind_encoding_round_trips(sys):
    for kind in (S, D, R, OTHER):
        assert syscalls.split_kind(syscalls.with_sys(kind, sys)) == (kind, sys)


def test_gpu_spin_is_a_synchronize_call():
    assert reasons.gpu_spin(stack(("cuStreamSynchronize", CUDA), ("[unknown] libcuda+0x10", CUDA)))
    assert reasons.gpu_spin(stack(("cudaDeviceSynchronize", "/x/libcudart.so.12")))
    assert not reasons.gpu_spin(stack(("cuLaunchKernel", CUDA)))
    assert not reasons.gpu_spin([python_frame("cudaDeviceSynchronize", "a.py", 1)])


def test_omp_spin_is_a_wait_reached_through_the_runtime_and_libc_only():
    """merge.Merger.omp_spin: from the leaf up through the OpenMP runtime's
    and the C library's frames, a wait function (one whose code spins) comes
    before any other code; what the runtime runs for the program is work."""
    from types import SimpleNamespace

    from pyoffcpu.profile.merge import Merger
    omp = "/usr/lib/x86_64-linux-gnu/libomp.so.5"
    wait = native_frame("libomp.so.5@0x7bdb0", omp)
    merger = SimpleNamespace(spin_frames={wait})

    def spins(*natives):
        return Merger.omp_spin(merger, tuple(stack(*natives, kernel=("schedule",))))
    assert spins(("start_thread", LIBC), ("libomp.so.5@0x7bdb0", omp))
    assert spins(("libomp.so.5@0x7bdb0", omp), ("__sched_yield", LIBC))           # yields while it waits
    assert spins(("libomp.so.5@0x7bdb0", omp), ("libomp.so.5@0x4bda0", omp))      # a helper of the wait
    # a task the waiting thread picked up, and what it calls: work
    assert not spins(("libomp.so.5@0x7bdb0", omp), ("task_body", "/app/libwork.so"))
    assert not spins(("libomp.so.5@0x7bdb0", omp), ("task_body", "/app/libwork.so"), ("memcpy", LIBC))
    assert not spins(("start_thread", LIBC), ("libomp.so.5@0x478c0", omp))        # no wait on the way
