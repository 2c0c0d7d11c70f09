/* pyoffcpu-elf: the heavy work on a target's ELF files, compiled, in a
 * process of its own (pytool/pyoffcpu/helper/__init__.py runs it): its
 * memory leaves with it, and a file built to make it loop or grow is
 * stopped by the limits its caller sets, not by pyoffcpu.
 *
 *   pyoffcpu-elf table [--no-prologue]   <ELF >TABLE   the unwind table
 *   pyoffcpu-elf symbols [DEBUG_FD]      <ELF >INDEX   the function index
 *
 * The ELF file is standard input (opened by the caller), the result goes
 * to standard output, errors are one line on standard error and exit 1. */
#include <stdio.h>
#include <string.h>

int cmd_table(int argc, char **argv);      /* tables.c */
int cmd_symbols(int argc, char **argv);    /* symbols.c */

int main(int argc, char **argv)
{
    if (argc >= 2 && strcmp(argv[1], "table") == 0)
        return cmd_table(argc - 1, argv + 1);
    if (argc >= 2 && strcmp(argv[1], "symbols") == 0)
        return cmd_symbols(argc - 1, argv + 1);
    fprintf(stderr, "usage: pyoffcpu-elf table [--no-prologue] <ELF >TABLE | "
                    "pyoffcpu-elf symbols [DEBUG_FD] <ELF >INDEX\n");
    return 2;
}
