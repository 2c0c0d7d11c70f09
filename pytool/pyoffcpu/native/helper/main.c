/* pyoffcpu-elf: the heavy work on a target's ELF files, compiled, in a
 * process of its own (pytool/pyoffcpu/native/helper/__init__.py runs it): its
 * memory leaves with it, and a file built to make it loop or grow is
 * stopped by the limits its caller sets, not by pyoffcpu.
 *
 *   pyoffcpu-elf table [--no-prologue]   <ELF >TABLE   the unwind table
 *   pyoffcpu-elf symbols [DEBUG_FD]      <ELF >INDEX   the function index
 *
 * The ELF file is standard input (opened by the caller), the result goes
 * to standard output, errors are one line on standard error and exit 1. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

int cmd_table(int argc, char **argv);      /* tables.c */
int cmd_symbols(int argc, char **argv);    /* symbols.c */

/* The limits the caller names in PYOFFCPU_HELPER_LIMITS ("CPU_SECONDS
 * ADDRESS_SPACE_BYTES"), set before the file is read; no core file.  The
 * caller starts us without code of its own between fork and exec. */
static int set_limits(void)
{
    const char *v = getenv("PYOFFCPU_HELPER_LIMITS");
    unsigned long long cpu, as;
    if (!v || sscanf(v, "%llu %llu", &cpu, &as) != 2)
        return -1;
    struct rlimit c = {cpu, cpu}, a = {as, as}, z = {0, 0};
    if (setrlimit(RLIMIT_CPU, &c) || setrlimit(RLIMIT_AS, &a) || setrlimit(RLIMIT_CORE, &z))
        return -1;
    return 0;
}

int main(int argc, char **argv)
{
    if (set_limits() != 0) {
        fprintf(stderr, "pyoffcpu-elf: no limits (PYOFFCPU_HELPER_LIMITS): not started by pyoffcpu\n");
        return 2;
    }
    if (argc >= 2 && strcmp(argv[1], "table") == 0)
        return cmd_table(argc - 1, argv + 1);
    if (argc >= 2 && strcmp(argv[1], "symbols") == 0)
        return cmd_symbols(argc - 1, argv + 1);
    fprintf(stderr, "usage: pyoffcpu-elf table [--no-prologue] <ELF >TABLE | "
                    "pyoffcpu-elf symbols [DEBUG_FD] <ELF >INDEX\n");
    return 2;
}
