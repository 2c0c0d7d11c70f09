"""The processes being profiled: each one's life (found, registered in BPF,
exec, fork, exit: processes), what /proc says of them (procfs), their
memory (memory) and their C library's thread layout (libc).
"""
