/* A library with code at 0x40000000 (linked with
 * -Wl,--section-start=.hightext=0x40000000): a few dozen bytes of code across
 * a 1 GiB address span.  Its unwind table's page index must be sized by the
 * rows, and the walk through both ends of the span still exact. */
long low(long n)
{
    volatile long s = 0;
    for (long i = 0; i < n; i++)
        s += i;
    return s;
}

__attribute__((section(".hightext"), noinline)) long high(long n)
{
    return low(n) + 2;          /* not a tail call: high stays on the stack */
}
