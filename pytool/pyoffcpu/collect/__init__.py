"""Collection: what the kernel gathers and how it reaches user space.

platform (root, BTF, tracefs: checked before anything loads), btf (kernel
struct offsets), bpfdefs (every constant and struct shared with bpf/, read
from its headers), bpfload (compile or take from the cache, load, attach)
and session (the loop: drain the maps into a Recording, one batch a turn,
for record, top and snapshot alike).
"""
