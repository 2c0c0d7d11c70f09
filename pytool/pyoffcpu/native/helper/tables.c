/* pyoffcpu-elf table [--no-prologue] <ELF >TABLE
 *
 * The unwind table of an ELF file, exactly the bytes of
 *     unwind_table.table_bytes(f, path, ElfCache())
 * (tests/reference/; --no-prologue: with PYOFFCPU_PROLOGUE=0).  The Python
 * is the reference and this file follows it: table_from_elf and
 * build_table here, .eh_frame in ehframe.c, the prologue analysis in
 * prologue.c, what pyelftools and ElfCache read in tables_elf.c.
 *
 * Where the Python raises on a malformed file (and its caller makes no
 * table), this fails: one line on stderr, exit 1.  It also fails, where
 * the Python would make a table, on what it does not read: ELF32 and
 * big-endian files (x32), zlib-compressed sections it would have to
 * inflate (.eh_frame, code, relocations, symbol tables), and past its
 * caps (ALLOC_CAP, a remember_state stack 4M states deep).  LEB128
 * numbers past 2^120 (a crafted file's) compare as equal to 2^120.
 *
 * Constants: bpf/unwind_defs.h, included (what bpfdefs.py reads). */
#include "tables.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>


#define PAGE_SHIFT 12
#define MIN_PAGE_SHIFT 6
#define PAGES_PER_ROW 4             /* table.max_pages() */
#define MIN_PAGES 256
#define MAX_ROWS_PER_PAGE (1u << UNWIND_SEARCH_STEPS)
static const char MAGIC[8] = "PYOFFUW2";

void fail(const char *fmt, ...)
{
    va_list ap;
    fputs("pyoffcpu-elf: table: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(1);
}

void *xmalloc(size_t n)
{
    if (n > ALLOC_CAP)
        fail("%zu bytes: past the cap", n);
    void *p = malloc(n ? n : 1);
    if (!p)
        fail("out of memory");
    return p;
}

void *xcalloc(size_t n, size_t size)
{
    if (size && n > ALLOC_CAP / size)
        fail("%zu x %zu bytes: past the cap", n, size);
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p)
        fail("out of memory");
    return p;
}

void *xrealloc(void *p, size_t n)
{
    if (n > ALLOC_CAP)
        fail("%zu bytes: past the cap", n);
    p = realloc(p, n ? n : 1);
    if (!p)
        fail("out of memory");
    return p;
}

size_t grow(size_t cap, size_t need, size_t elem)
{
    size_t c = cap ? cap : 16;
    while (c < need) {
        if (c > ALLOC_CAP / 2 / elem)
            fail("%zu elements: past the cap", need);
        c *= 2;
    }
    if (c > ALLOC_CAP / elem)
        fail("%zu elements: past the cap", need);
    return c;
}

void entries_add(struct entries *es, pint loc, uint32_t prio, uint32_t enc)
{
    if (loc < 0) {
        es->negative = 1;
    } else if (loc >= U64_END) {
        struct hentry h = {loc, enc, prio, es->nseq++};
        VPUSH(es->high, h);
    } else {
        struct entry e = {(uint64_t)loc, enc, prio};
        VPUSH(es->e, e);
    }
}

/* ------------------------------------------------------------------ */
/* Sorting                                                             */

/* LSD radix sort of n records of `size` bytes (8 or 16) by the key bytes
 * at offsets keys[0] (least significant) .. keys[nk - 1]; stable.  Bytes
 * where every record has the same value take no pass. */
static void radix(void *recs, size_t n, size_t size, const int *keys, int nk)
{
    if (n < 2)
        return;
    size_t (*count)[256] = xcalloc((size_t)nk, sizeof(*count));
    unsigned char *a = recs;
    for (size_t i = 0; i < n; i++)
        for (int k = 0; k < nk; k++)
            count[k][a[i * size + keys[k]]]++;
    unsigned char *tmp = 0, *src = a, *dst = 0;
    for (int k = 0; k < nk; k++) {
        size_t *c = count[k];
        if (c[a[keys[k]]] == n)
            continue;                   /* one value: nothing to do (a[0] is still in the set) */
        if (!tmp)
            tmp = xmalloc(n * size);
        dst = src == a ? tmp : a;
        size_t pos[256], sum = 0;
        for (int b = 0; b < 256; b++) {
            pos[b] = sum;
            sum += c[b];
        }
        int off = keys[k];
        if (size == 16) {
            for (size_t i = 0; i < n; i++)
                memcpy(dst + 16 * pos[src[16 * i + off]]++, src + 16 * i, 16);
        } else {
            for (size_t i = 0; i < n; i++)
                memcpy(dst + size * pos[src[size * i + off]]++, src + size * i, size);
        }
        src = dst;
    }
    if (src != a)
        memcpy(a, src, n * size);
    free(tmp);
    free(count);
}

static int cmp_pint(const void *a, const void *b)
{
    pint x = *(const pint *)a, y = *(const pint *)b;
    return x < y ? -1 : x > y;
}

void sort_pints(pint *a, size_t n)
{
    if (n < 2)
        return;
    pint lo = a[0], hi = a[0];
    for (size_t i = 1; i < n; i++) {
        if (a[i] < lo)
            lo = a[i];
        if (a[i] > hi)
            hi = a[i];
    }
    if (hi - lo >= U64_END) {
        qsort(a, n, sizeof(*a), cmp_pint);
        return;
    }
    uint64_t *k = xmalloc(n * sizeof(*k));
    for (size_t i = 0; i < n; i++)
        k[i] = (uint64_t)(a[i] - lo);
    static const int keys[] = {0, 1, 2, 3, 4, 5, 6, 7};
    radix(k, n, 8, keys, 8);
    for (size_t i = 0; i < n; i++)
        a[i] = lo + k[i];
    free(k);
}

static int cmp_span(const void *a, const void *b)
{
    const struct span *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

/* sorted((begin, end) tuples) */
void sort_spans(struct span *a, size_t n)
{
    if (n < 2)
        return;
    for (size_t i = 0; i < n; i++)
        if (a[i].begin < 0 || a[i].begin >= U64_END || a[i].end < 0 || a[i].end >= U64_END) {
            qsort(a, n, sizeof(*a), cmp_span);
            return;
        }
    uint64_t *k = xmalloc(n * 2 * sizeof(*k));
    for (size_t i = 0; i < n; i++) {
        k[2 * i] = (uint64_t)a[i].begin;
        k[2 * i + 1] = (uint64_t)a[i].end;
    }
    static const int keys[] = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
    radix(k, n, 16, keys, 16);
    for (size_t i = 0; i < n; i++) {
        a[i].begin = k[2 * i];
        a[i].end = k[2 * i + 1];
    }
    free(k);
}

static int cmp_hentry(const void *a, const void *b)
{
    const struct hentry *x = a, *y = b;
    if (x->loc != y->loc)
        return x->loc < y->loc ? -1 : 1;
    if (x->prio != y->prio)
        return x->prio < y->prio ? -1 : 1;
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

/* ------------------------------------------------------------------ */
/* build_table and serialize                                           */

static void write_all(const void *p, size_t n)
{
    const char *c = p;
    while (n) {
        ssize_t w = write(1, c, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            fail("cannot write the table");
        c += w;
        n -= (size_t)w;
    }
}

struct row {
    uint32_t pc;
    uint32_t enc;               /* ENC() until written out */
};

/* _page_index: pages[0..npages] */
static uint32_t *page_index(const struct row *rows, size_t n, unsigned shift, size_t *npages)
{
    size_t np = ((size_t)rows[n - 1].pc >> shift) + 1;
    uint32_t *pages = xmalloc((np + 1) * sizeof(*pages));
    size_t i = 0;
    for (size_t p = 0; p < np; p++) {
        uint64_t start = (uint64_t)p << shift;
        while (i + 1 < n && rows[i + 1].pc <= start)
            i++;
        pages[p] = (uint32_t)i;
    }
    pages[np] = (uint32_t)(n - 1);
    *npages = np;
    return pages;
}

static uint64_t max_rows_per_page(const uint32_t *pages, size_t npages)
{
    uint64_t m = 0;
    for (size_t i = 0; i < npages; i++)
        if ((uint64_t)pages[i + 1] - pages[i] + 1 > m)
            m = (uint64_t)pages[i + 1] - pages[i] + 1;
    return m;
}

static void put32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }

/* build_table(fdes, derived=...) then serialize(): derived entries come
 * first in the Python's list (a sort is stable: they win ties) */
static void build_and_write(struct entries *der, struct entries *fde, uint64_t unsupported)
{
    unsigned char hdr[32];
    memcpy(hdr, MAGIC, 8);
    size_t ne = der->e.n + fde->e.n, nh = der->high.n + fde->high.n;
    if (der->negative || fde->negative)
        fail("an address below 0: the table base would be");     /* struct.error in serialize */
    if (ne == 0 && nh == 0) {
        uint32_t zero = 0;
        put64(hdr + 8, 0);
        put32(hdr + 16, 0);
        put32(hdr + 20, 0);
        put32(hdr + 24, 0);
        put32(hdr + 28, PAGE_SHIFT);
        write_all(hdr, sizeof(hdr));
        write_all(&zero, 4);
        return;
    }
    struct entry *e = der->e.v;
    VRESERVE(der->e, ne);
    e = der->e.v;
    if (fde->e.n)
        memcpy(e + der->e.n, fde->e.v, fde->e.n * sizeof(*e));
    VFREE(fde->e);
    der->e.n = 0;
    /* sort by (loc, priority), stable */
    static const int keys[] = {12, 0, 1, 2, 3, 4, 5, 6, 7};
    radix(e, ne, sizeof(*e), keys, 9);
    struct hentry *h = xmalloc((nh + 1) * sizeof(*h));
    if (der->high.n)
        memcpy(h, der->high.v, der->high.n * sizeof(*h));
    for (size_t i = 0; i < fde->high.n; i++) {
        h[der->high.n + i] = fde->high.v[i];
        h[der->high.n + i].seq += der->nseq;
    }
    if (nh > 1)
        qsort(h, nh, sizeof(*h), cmp_hentry);
    pint first = ne ? (pint)e[0].loc : h[0].loc;
    pint base = first & ~(pint)((1 << PAGE_SHIFT) - 1);
    if (base >= U64_END)
        fail("a table base past 2^64");                         /* struct.error in serialize */
    VEC(struct row) rows = {0, 0, 0};
    int have_loc = 0, have_enc = 0;
    pint last_loc = 0;
    uint32_t last_enc = 0;
    for (size_t k = 0; k < ne + nh; k++) {
        pint loc = k < ne ? (pint)e[k].loc : h[k - ne].loc;
        uint32_t enc = k < ne ? e[k].enc : h[k - ne].enc;
        if (have_loc && loc == last_loc)
            continue;                   /* an earlier entry at the same loc won */
        have_loc = 1;
        last_loc = loc;
        if (have_enc && enc == last_enc)
            continue;
        have_enc = 1;
        last_enc = enc;
        pint rel = loc - base;
        if (rel >= (pint)1 << 32)
            break;                      /* objects over 4 GiB of code: rest unsupported */
        if (enc == ENC_BAD)
            fail("a derived row past what a row holds");        /* struct.error in ROW.pack */
        struct row r = {(uint32_t)rel, enc};
        VPUSH(rows, r);
    }
    free(e);
    der->e.v = 0;
    der->e.cap = 0;
    free(h);
    if (unsupported > 0xFFFFFFFFu)
        fail("too many unsupported rows");
    /* table.page_shift(): 4 KiB pages, smaller where a page holds more rows
     * than the BPF search takes, never more pages than max_pages() */
    size_t cap = PAGES_PER_ROW * rows.n + MIN_PAGES;
    uint64_t last = rows.v[rows.n - 1].pc;
    unsigned shift = PAGE_SHIFT;
    while ((last >> shift) + 1 > cap)
        shift++;
    size_t npages;
    uint32_t *pages = page_index(rows.v, rows.n, shift, &npages);
    while (shift > MIN_PAGE_SHIFT && (last >> (shift - 1)) + 1 <= cap
           && max_rows_per_page(pages, npages) > MAX_ROWS_PER_PAGE) {
        free(pages);
        shift--;
        pages = page_index(rows.v, rows.n, shift, &npages);
    }
    put64(hdr + 8, (uint64_t)base);
    put32(hdr + 16, (uint32_t)rows.n);
    put32(hdr + 20, (uint32_t)npages);
    put32(hdr + 24, (uint32_t)unsupported);
    put32(hdr + 28, shift);
    write_all(hdr, sizeof(hdr));
    /* struct unwind_row: u32 pc, s16 cfa_off, u8 kind, s8 rbp */
    for (size_t i = 0; i < rows.n; i++) {
        uint32_t enc = rows.v[i].enc;
        unsigned char *b = (unsigned char *)&rows.v[i];
        uint32_t pc = rows.v[i].pc;
        put32(b, pc);
        b[4] = enc >> 8 & 0xFF;         /* cfa_off */
        b[5] = enc >> 16 & 0xFF;
        b[6] = enc & 0xFF;              /* kind */
        b[7] = enc >> 24 & 0xFF;        /* rbp */
    }
    write_all(rows.v, rows.n * sizeof(struct row));
    write_all(pages, (npages + 1) * sizeof(*pages));
    free(pages);
    VFREE(rows);
}

/* --into PATH: the table goes to PATH.<pid>.tmp, renamed to PATH once
 * whole (a reader never sees half a table); a failure leaves nothing. */
static char into_tmp[4096];
static int into_done;

static void into_cleanup(void)
{
    if (into_tmp[0] && !into_done)
        unlink(into_tmp);
}

static int into_open(const char *path)
{
    if (snprintf(into_tmp, sizeof(into_tmp), "%s.%d.tmp", path, (int)getpid()) >= (int)sizeof(into_tmp))
        return -1;
    int fd = open(into_tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
        into_tmp[0] = 0;
        return -1;
    }
    atexit(into_cleanup);
    if (dup2(fd, 1) < 0)
        return -1;
    close(fd);
    return 0;
}

int cmd_table(int argc, char **argv)
{
    int prologue = 1;
    const char *into = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--no-prologue") == 0) {
            prologue = 0;
        } else if (strcmp(argv[i], "--into") == 0 && i + 1 < argc) {
            into = argv[++i];
        } else {
            fprintf(stderr, "usage: pyoffcpu-elf table [--no-prologue] [--into PATH] <ELF >TABLE\n");
            return 2;
        }
    }
    if (into && into_open(into) != 0) {
        fprintf(stderr, "pyoffcpu-elf: table: cannot write %s\n", into);
        return 1;
    }
    struct pyelf pe;
    pyelf_open(&pe, 0);
    struct entries der, fde;
    memset(&der, 0, sizeof(der));
    memset(&fde, 0, sizeof(fde));
    spanvec spans = {0, 0, 0};
    uint64_t unsupported = 0;
    const struct psec *eh = pyelf_by_name(&pe, ".eh_frame");
    if (eh && eh->type != PY_SHT_NOBITS) {
        struct bytes data = pyelf_data(&pe, eh);
        unsupported = ehframe_entries(data, eh->addr, &fde, &spans);
        elf_release(&pe.f, data.p, data.n);
    }
    if (prologue) {
        symvec syms = {0, 0, 0};
        pyelf_function_symbols(&pe, &syms);
        derived_rows(&pe, &spans, &syms, &der);
        VFREE(syms);
    }
    VFREE(spans);
    pyelf_close(&pe);
    build_and_write(&der, &fde, unsupported);
    VFREE(der.high);
    VFREE(fde.high);
    if (into) {
        if (rename(into_tmp, into) != 0) {
            fprintf(stderr, "pyoffcpu-elf: table: cannot rename into %s\n", into);
            return 1;
        }
        into_done = 1;
    }
    return 0;
}
