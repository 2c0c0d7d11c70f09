"""Native stacks without frame pointers: .eh_frame (DWARF CFI) tables built
in user space (ehframe.py -> table.py), searched by the BPF unwinder
(bpf/unwind.c), loaded and kept in step with the targets' mappings by
loader.py."""
