"""Native stacks without frame pointers: tables of .eh_frame (DWARF CFI) and
prologue-analysis rows, made by the compiled helper (build.py starts the
builds, table.py holds the format and the disk cache), searched by the BPF
unwinder (bpf/unwind.c), loaded and kept in step with the targets'
mappings by loader.py; walk.py and stacks.py walk the same tables in user
space (a core file, a blocked thread's dump)."""
