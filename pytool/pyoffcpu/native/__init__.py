"""Native code: ELF files read once per session by identity (fileidentity:
what a file is; elffile: what is read out of it; elfcache: the session's
files by identity), a process's mappings (procmaps), the function names of
their code (symindex, symbols, debugfiles, kernelsyms, demangle), glibc's
thread layout (libc), and the unwinder that walks native stacks from
.eh_frame and prologue analysis (unwind/), with the compiled helper that
makes its tables and the function indexes (helper/: the one builder;
tests/reference/ holds its Python reference).
"""
