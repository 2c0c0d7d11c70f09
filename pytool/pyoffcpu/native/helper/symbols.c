/* pyoffcpu-elf symbols [DEBUG_FD] <ELF >INDEX: the function index of a file
 * (and of its separate debug file), the format symindex.py reads; the
 * bytes of tests/reference/symbol_index.py's build_bytes:
 *
 *   header (64 bytes, little-endian)
 *     0  magic "PYOFSYMI"          8  u32 version (1)     12 u32 0
 *     16 u64 nfuncs                24 u64 nfdes           32 u64 names_size
 *     40..63 zero
 *   u64 starts[nfuncs]   sorted, distinct
 *   u64 ends[nfuncs]
 *   u64 names[nfuncs+1]  name i is blob[names[i] .. names[i+1])
 *   u64 fde_starts[nfdes] sorted, distinct
 *   u64 fde_ends[nfdes]
 *   names_size bytes: the names blob (raw symbol names, no separators)
 *
 * Which symbols and which name win is functable.function_table's rule, which
 * this reproduces on the raw bytes of the names (symindex.py builds the
 * same bytes in Python where this binary is missing; tests compare both):
 *
 *   - every SHT_SYMTAB / SHT_DYNSYM of the file, then of the debug file, in
 *     section order; a symbol counts when it is defined (st_shndx != 0),
 *     named (st_name != 0), st_value != 0, of type FUNC or GNU_IFUNC;
 *   - its end: st_value + st_size; unsized: the end of its section (an
 *     ordinary section index), else unknown;
 *   - one name per address, the least by (global < weak < local < other,
 *     sized < unsized, not "_"-prefixed < "_"-prefixed, shorter < longer,
 *     then byte order); the end the greatest of all symbols there;
 *   - then, in address order: an unknown end is the next start (or start+1
 *     for the last); the end of a symbol whose chosen name is unsized is cut
 *     at the next start.
 *
 * FDEs: pc_begin / pc_begin + pc_range of every FDE of the file's .eh_frame
 * (pc_range 0 and ranges past 2^64 left out), sorted, one per start (the
 * longest); parsing stops at the first malformed entry (what came before
 * is kept).  symindex.fde_ranges is the same in Python. */
#include "elf.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define INDEX_VERSION 1
#define HEADER_SIZE 64

struct cand {
    uint64_t value, end;
    const unsigned char *name;
    uint32_t len;
    uint8_t bind_rank, unsized, underscore;
};

struct func {
    uint64_t start, end;
    const unsigned char *name;
    uint32_t len;
    uint8_t unsized;
};

struct range {
    uint64_t start, end;
};

struct vec {
    void *p;
    size_t n, cap, size;
};

static void *vec_push(struct vec *v)
{
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 1024;
        void *p = realloc(v->p, cap * v->size);
        if (!p) {
            fprintf(stderr, "pyoffcpu-elf: symbols: out of memory\n");
            exit(1);
        }
        v->p = p;
        v->cap = cap;
    }
    return (char *)v->p + v->n++ * v->size;
}

/* Ask for a range of the mapping to be read in at once: libtorch_cpu.so's
 * tables are 90 MB, a page fault per 4 KiB otherwise. */
static void prefetch(const void *p, size_t n)
{
    uintptr_t lo = (uintptr_t)p & ~(uintptr_t)4095;
    if (n)
        madvise((void *)lo, n + ((uintptr_t)p - lo), MADV_WILLNEED);
}

static uint64_t sat_add(uint64_t a, uint64_t b)
{
    return a + b < a ? UINT64_MAX : a + b;
}

/* A section's bytes as far as they lie in the file (a read at sh_offset of
 * sh_size bytes, short at the end of the file); none for SHT_NOBITS. */
static void section_bytes(const struct elf_file *f, const Elf64_Shdr *s,
                          const unsigned char **p, size_t *n)
{
    *p = f->data;
    *n = 0;
    if (s->sh_type == SHT_NOBITS || s->sh_offset >= f->size)
        return;
    *p = f->data + s->sh_offset;
    *n = s->sh_size < f->size - s->sh_offset ? (size_t)s->sh_size : f->size - s->sh_offset;
    prefetch(*p, *n);
}

static int bind_rank(unsigned bind)
{
    return bind == STB_GLOBAL ? 0 : bind == STB_WEAK ? 1 : bind == STB_LOCAL ? 2 : 3;
}

/* The function symbols of one file onto cands; -1 with why in err. */
static int collect(const struct elf_file *f, struct vec *cands, char *err, size_t errlen)
{
    for (unsigned i = 0; i < f->shnum; i++) {
        const Elf64_Shdr *s = &f->sh[i];
        if (s->sh_type != SHT_SYMTAB && s->sh_type != SHT_DYNSYM)
            continue;
        if (s->sh_link >= f->shnum || f->sh[s->sh_link].sh_type != SHT_STRTAB) {
            snprintf(err, errlen, "symbol table %u links to no string table", i);
            return -1;
        }
        const Elf64_Shdr *strs = &f->sh[s->sh_link];
        if ((s->sh_flags | strs->sh_flags) & SHF_COMPRESSED) {
            snprintf(err, errlen, "compressed symbol table %u", i);
            return -1;
        }
        const unsigned char *syms, *strtab;
        size_t nsyms, nstr;
        section_bytes(f, s, &syms, &nsyms);
        section_bytes(f, strs, &strtab, &nstr);
        for (size_t k = 0; k + sizeof(Elf64_Sym) <= nsyms; k += sizeof(Elf64_Sym)) {
            Elf64_Sym sym;
            memcpy(&sym, syms + k, sizeof(sym));
            unsigned type = ELF64_ST_TYPE(sym.st_info);
            if (sym.st_shndx == SHN_UNDEF || sym.st_name == 0 || sym.st_value == 0)
                continue;
            if (type != STT_FUNC && type != STT_GNU_IFUNC)
                continue;
            const unsigned char *name = strtab;
            size_t len = 0;
            if (sym.st_name < nstr) {
                name = strtab + sym.st_name;
                const unsigned char *nul = memchr(name, 0, nstr - sym.st_name);
                len = nul ? (size_t)(nul - name) : nstr - sym.st_name;
            }
            if (len > UINT32_MAX)
                len = UINT32_MAX;   /* (a 4 GB name: never in a real file) */
            uint64_t end = 0;
            if (sym.st_size)
                end = sat_add(sym.st_value, sym.st_size);
            else if (sym.st_shndx < f->shnum && sym.st_shndx < SHN_LORESERVE)
                end = sat_add(f->sh[sym.st_shndx].sh_addr, f->sh[sym.st_shndx].sh_size);
            struct cand *c = vec_push(cands);
            c->value = sym.st_value;
            c->end = end;
            c->name = name;
            c->len = (uint32_t)len;
            c->bind_rank = (uint8_t)bind_rank(ELF64_ST_BIND(sym.st_info));
            c->unsized = sym.st_size == 0;
            c->underscore = len > 0 && name[0] == '_';
        }
    }
    return 0;
}

/* By address, then best name first. */
static int cand_cmp(const void *pa, const void *pb)
{
    const struct cand *a = pa, *b = pb;
    if (a->value != b->value)
        return a->value < b->value ? -1 : 1;
    if (a->bind_rank != b->bind_rank)
        return a->bind_rank < b->bind_rank ? -1 : 1;
    if (a->unsized != b->unsized)
        return a->unsized < b->unsized ? -1 : 1;
    if (a->underscore != b->underscore)
        return a->underscore < b->underscore ? -1 : 1;
    if (a->len != b->len)
        return a->len < b->len ? -1 : 1;
    return memcmp(a->name, b->name, a->len);
}

/* -- .eh_frame ------------------------------------------------------------ */
struct reader {
    const unsigned char *d;
    size_t pos, end;
    int bad;
};

static unsigned rd_u8(struct reader *r)
{
    if (r->bad || r->pos >= r->end) {
        r->bad = 1;
        return 0;
    }
    return r->d[r->pos++];
}

static uint64_t rd_fixed(struct reader *r, unsigned n)
{
    if (r->bad || r->end - r->pos < n || r->pos > r->end) {
        r->bad = 1;
        return 0;
    }
    uint64_t v = 0;
    for (unsigned i = 0; i < n; i++)
        v |= (uint64_t)r->d[r->pos + i] << (8 * i);
    r->pos += n;
    return v;
}

static uint64_t rd_uleb(struct reader *r)
{
    uint64_t v = 0;
    unsigned shift = 0;
    for (;;) {
        unsigned b = rd_u8(r);
        if (r->bad)
            return 0;
        if (shift < 64)
            v |= (uint64_t)(b & 0x7f) << shift;
        shift += 7;
        if (b < 0x80)
            return v;
    }
}

static uint64_t rd_sleb(struct reader *r)
{
    uint64_t v = 0;
    unsigned shift = 0;
    for (;;) {
        unsigned b = rd_u8(r);
        if (r->bad)
            return 0;
        if (shift < 64)
            v |= (uint64_t)(b & 0x7f) << shift;
        shift += 7;
        if (b < 0x80) {
            if ((b & 0x40) && shift < 64)
                v |= ~(uint64_t)0 << shift;
            return v;
        }
    }
}

/* A DW_EH_PE value of the format enc & 0x0f (ehframe.read_encoded's). */
static uint64_t rd_format(struct reader *r, unsigned enc)
{
    switch (enc & 0x0f) {
    case 0x00: return rd_fixed(r, 8);                           /* absptr */
    case 0x01: return rd_uleb(r);
    case 0x02: return rd_fixed(r, 2);
    case 0x03: return rd_fixed(r, 4);
    case 0x04: return rd_fixed(r, 8);
    case 0x09: return rd_sleb(r);
    case 0x0a: return (uint64_t)(int64_t)(int16_t)rd_fixed(r, 2);
    case 0x0b: return (uint64_t)(int64_t)(int32_t)rd_fixed(r, 4);
    case 0x0c: return rd_fixed(r, 8);
    }
    r->bad = 1;
    return 0;
}

/* A pointer: the format, then the application (pcrel: + the field's own
 * address; datarel: + 0, as ehframe.py; absolute and aligned: as is). */
static uint64_t rd_pointer(struct reader *r, unsigned enc, uint64_t section_addr)
{
    uint64_t field = section_addr + r->pos;
    uint64_t v = rd_format(r, enc);
    switch (enc & 0x70) {
    case 0x00: case 0x30: case 0x50:
        return v;
    case 0x10:
        return v + field;
    }
    r->bad = 1;
    return 0;
}

/* The entry (CIE or FDE) at pos: its body [*body, *end); -1: malformed. */
static int entry_at(const unsigned char *d, size_t n, size_t pos, size_t *body, size_t *end)
{
    struct reader r = {d, pos, n, 0};
    uint64_t len = rd_fixed(&r, 4);
    if (r.bad || len == 0)
        return -1;
    if (len == 0xffffffffu) {
        len = rd_fixed(&r, 8);
        if (r.bad)
            return -1;
    }
    if (len > n - r.pos || len < 4)
        return -1;
    *body = r.pos;
    *end = r.pos + (size_t)len;
    return 0;
}

/* The FDE pointer encoding of the CIE at pos; -1: malformed. */
static int cie_encoding(const unsigned char *d, size_t n, size_t pos)
{
    size_t body, end;
    if (entry_at(d, n, pos, &body, &end) != 0)
        return -1;
    struct reader r = {d, body, end, 0};
    if (rd_fixed(&r, 4) != 0 || r.bad)
        return -1;                                  /* not a CIE */
    unsigned version = rd_u8(&r);
    if (r.bad)
        return -1;
    const unsigned char *aug = d + r.pos;
    const unsigned char *nul = memchr(aug, 0, end - r.pos);
    if (!nul)
        return -1;
    size_t auglen = (size_t)(nul - aug);
    r.pos += auglen + 1;
    int eh = 0;
    for (size_t i = 0; i + 1 < auglen; i++)
        if (aug[i] == 'e' && aug[i + 1] == 'h')
            eh = 1;
    if (eh)
        r.pos = r.pos + 8 <= end ? r.pos + 8 : end + 1;
    if (version >= 4)
        r.pos = r.pos + 2 <= end ? r.pos + 2 : end + 1;
    if (r.pos > end)
        return -1;
    rd_uleb(&r);                                    /* code alignment */
    rd_sleb(&r);                                    /* data alignment */
    if (version == 1)
        rd_u8(&r);
    else
        rd_uleb(&r);                                /* return address register */
    if (r.bad)
        return -1;
    unsigned enc = 0;                               /* DW_EH_PE_absptr */
    if (auglen && aug[0] == 'z') {
        rd_uleb(&r);                                /* augmentation data length */
        for (size_t i = 1; i < auglen && !r.bad; i++) {
            unsigned char ch = aug[i];
            if (ch == 'R') {
                enc = rd_u8(&r);
            } else if (ch == 'L') {
                rd_u8(&r);
            } else if (ch == 'P') {
                unsigned penc = rd_u8(&r);
                if (!r.bad)
                    rd_format(&r, penc);
            } else if (ch != 'S' && ch != 'B' && ch != 'G') {
                break;
            }
        }
        if (r.bad)
            return -1;
    } else if (!(auglen == 0 || (auglen == 2 && aug[0] == 'e' && aug[1] == 'h'))) {
        return -1;
    }
    return (int)enc;
}

struct cie_memo {
    size_t pos;
    int enc;
};

static int range_cmp(const void *pa, const void *pb)
{
    const struct range *a = pa, *b = pb;
    if (a->start != b->start)
        return a->start < b->start ? -1 : 1;
    if (a->end != b->end)
        return a->end < b->end ? -1 : 1;
    return 0;
}

static void fde_ranges(const unsigned char *d, size_t n, uint64_t addr, struct vec *out)
{
    struct cie_memo last = {(size_t)-1, -1};       /* CIEs are mostly reused in a row */
    size_t pos = 0;
    while (pos <= n && n - pos >= 4) {
        size_t body, end;
        if (entry_at(d, n, pos, &body, &end) != 0)
            break;
        struct reader r = {d, body, end, 0};
        uint64_t id = rd_fixed(&r, 4);
        if (id == 0) {
            if (cie_encoding(d, n, pos) < 0)
                break;
            pos = end;
            continue;
        }
        if (id > body)
            break;
        size_t cie_pos = body - (size_t)id;
        int enc = last.pos == cie_pos ? last.enc : cie_encoding(d, n, cie_pos);
        if (enc < 0)
            break;
        last.pos = cie_pos;
        last.enc = enc;
        uint64_t begin = rd_pointer(&r, (unsigned)enc, addr);
        uint64_t range = rd_format(&r, (unsigned)enc);
        if (r.bad)
            break;
        pos = end;
        if (range == 0 || begin + range < begin)
            continue;
        struct range *e = vec_push(out);
        e->start = begin;
        e->end = begin + range;
    }
    if (out->n == 0)
        return;
    struct range *v = out->p;
    qsort(v, out->n, sizeof(*v), range_cmp);
    size_t k = 0;
    for (size_t i = 0; i < out->n; i++) {
        if (k && v[k - 1].start == v[i].start)
            v[k - 1] = v[i];                        /* sorted by end: the longest stays */
        else
            v[k++] = v[i];
    }
    out->n = k;
}

/* -- output --------------------------------------------------------------- */
static void put_u64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static int write_all(const void *p, size_t n)
{
    return n == 0 || fwrite(p, 1, n, stdout) == n ? 0 : -1;
}

static int write_u64s(const uint64_t *v, size_t n, size_t stride)
{
    unsigned char buf[8 * 1024];
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        put_u64(buf + k, *(const uint64_t *)((const char *)v + i * stride));
        k += 8;
        if (k == sizeof(buf)) {
            if (write_all(buf, k) != 0)
                return -1;
            k = 0;
        }
    }
    return write_all(buf, k);
}

int cmd_symbols(int argc, char **argv)
{
    char err[256] = "";
    struct elf_file files[2];
    int nfiles = 0;
    if (argc > 2) {
        fprintf(stderr, "usage: pyoffcpu-elf symbols [DEBUG_FD] <ELF >INDEX\n");
        return 2;
    }
    int fds[2] = {0, -1};
    if (argc == 2) {
        char *e;
        errno = 0;
        long fd = strtol(argv[1], &e, 10);
        if (errno || *e || e == argv[1] || fd < 0 || fd > 1 << 20) {
            fprintf(stderr, "pyoffcpu-elf: symbols: bad descriptor %s\n", argv[1]);
            return 2;
        }
        fds[1] = (int)fd;
    }
    for (int i = 0; i < 2 && fds[i] >= 0; i++) {
        if (elf_open_fd(&files[i], fds[i], err, sizeof(err)) != 0) {
            fprintf(stderr, "pyoffcpu-elf: symbols: %s: %s\n", i ? "debug file" : "file", err);
            return 1;
        }
        nfiles++;
    }

    struct vec cands = {0, 0, 0, sizeof(struct cand)};
    for (int i = 0; i < nfiles; i++) {
        if (collect(&files[i], &cands, err, sizeof(err)) != 0) {
            fprintf(stderr, "pyoffcpu-elf: symbols: %s: %s\n", i ? "debug file" : "file", err);
            return 1;
        }
    }
    struct cand *c = cands.p;
    if (cands.n)
        qsort(c, cands.n, sizeof(*c), cand_cmp);

    /* one per address: the first (best) name, the greatest end */
    struct vec funcs = {0, 0, 0, sizeof(struct func)};
    for (size_t i = 0; i < cands.n; i++) {
        struct func *last = funcs.n ? (struct func *)funcs.p + funcs.n - 1 : 0;
        if (last && last->start == c[i].value) {
            if (c[i].end > last->end)
                last->end = c[i].end;
            continue;
        }
        struct func *f = vec_push(&funcs);
        f->start = c[i].value;
        f->end = c[i].end;
        f->name = c[i].name;
        f->len = c[i].len;
        f->unsized = c[i].unsized;
    }
    struct func *fn = funcs.p;
    uint64_t names_size = 0;
    for (size_t i = 0; i < funcs.n; i++) {
        int has_next = i + 1 < funcs.n;
        uint64_t next = has_next ? fn[i + 1].start : 0;
        if (fn[i].end <= fn[i].start)
            fn[i].end = has_next ? next : sat_add(fn[i].start, 1);
        else if (fn[i].unsized && has_next && next < fn[i].end)
            fn[i].end = next;
        names_size += fn[i].len;
    }

    struct vec fdes = {0, 0, 0, sizeof(struct range)};
    const Elf64_Shdr *eh = elf_section(&files[0], ".eh_frame");
    const unsigned char *ehp;
    size_t ehn;
    if (eh && elf_section_data(&files[0], eh, &ehp, &ehn) == 0) {
        prefetch(ehp, ehn);
        fde_ranges(ehp, ehn, eh->sh_addr, &fdes);
    }

    unsigned char hdr[HEADER_SIZE] = "PYOFSYMI";
    memset(hdr + 8, 0, HEADER_SIZE - 8);
    hdr[8] = INDEX_VERSION;
    put_u64(hdr + 16, funcs.n);
    put_u64(hdr + 24, fdes.n);
    put_u64(hdr + 32, names_size);
    int bad = write_all(hdr, sizeof(hdr));
    if (funcs.n) {
        bad |= write_u64s(&fn[0].start, funcs.n, sizeof(struct func));
        bad |= write_u64s(&fn[0].end, funcs.n, sizeof(struct func));
    }
    uint64_t off = 0;
    for (size_t i = 0; i <= funcs.n && !bad; i++) {
        unsigned char b[8];
        put_u64(b, off);
        bad |= write_all(b, 8);
        if (i < funcs.n)
            off += fn[i].len;
    }
    struct range *fr = fdes.p;
    if (fdes.n) {
        bad |= write_u64s(&fr[0].start, fdes.n, sizeof(struct range));
        bad |= write_u64s(&fr[0].end, fdes.n, sizeof(struct range));
    }
    for (size_t i = 0; i < funcs.n && !bad; i++)
        bad |= write_all(fn[i].name, fn[i].len);
    if (bad || fflush(stdout) != 0) {
        fprintf(stderr, "pyoffcpu-elf: symbols: cannot write the index\n");
        return 1;
    }
    return 0;
}
