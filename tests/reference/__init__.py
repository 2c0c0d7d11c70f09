"""Python references of what the compiled helper (pyoffcpu-elf) computes:
unwind tables (ehframe, prologue, unwind_table) and function indexes
(functable, fderanges, symbol_index).  The product runs the helper alone;
the tests hold its output to these, byte for byte."""
