#include <stdio.h>

int cmd_table(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    fprintf(stderr, "pyoffcpu-elf: table: not written yet\n");
    return 1;
}
