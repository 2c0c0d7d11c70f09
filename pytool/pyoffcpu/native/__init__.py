"""Native code: ELF files read once per session by identity (elffile), the
function names of their code (symindex, symbols, demangle), and the
unwinder that walks native stacks from .eh_frame and prologue analysis
(unwind/), with the compiled helper that makes its tables (helper/).
"""
