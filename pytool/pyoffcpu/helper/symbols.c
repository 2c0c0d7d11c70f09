#include <stdio.h>

int cmd_symbols(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    fprintf(stderr, "pyoffcpu-elf: symbols: not written yet\n");
    return 1;
}
