"""The kernel's side, shared by every stage: the constants and structs
bpf/ shares with user space, read from its headers (bpfdefs), the bpf(2)
system call and the BPF objects it makes (bpfsys), the perf buffers BPF
sends records through (perfring), the kernel's BTF (btf: struct offsets,
tracepoint arguments), and the system calls a wait is told by (syscalls).
A leaf: it imports nothing else of pyoffcpu but cachedir.
"""
