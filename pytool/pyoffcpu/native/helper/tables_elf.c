/* The ELF file of a table as the Python side reads it: pyelftools 0.33's
 * ELFFile (the checks its section objects make when they are built, which
 * raise on a malformed file, and then table_from_elf makes no table), and
 * pyoffcpu's ElfCache/ElfFile for the function symbols (whose failures
 * only leave the symbols out).
 *
 * Python reads through a buffered file: a seek past the end is allowed up
 * to what the file system allows (lseek says, on the same descriptor), a
 * read past it is short, and a read of n bytes allocates n first (a
 * MemoryError past what the machine can give). */
#include "tables.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/sysinfo.h>
#include <unistd.h>

/* what a Python read of n bytes may allocate before MemoryError */
static pint mem_limit(void)
{
    static pint limit = -1;
    if (limit < 0) {
        struct sysinfo si;
        struct rlimit rl;
        limit = (pint)1 << 62;
        if (sysinfo(&si) == 0)
            limit = ((pint)si.totalram + si.totalswap) * si.mem_unit;
        if (getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && (pint)rl.rlim_cur < limit)
            limit = rl.rlim_cur;
    }
    return limit;
}

/* stream.seek(pos): 0, or -1 where it raises (ValueError past 2^63,
 * OSError where the file system refuses the offset) */
static int py_seek(const struct pyelf *pe, pint pos)
{
    if (pos < 0 || pos >= (pint)1 << 63)
        return -1;
    if (pos <= (pint)pe->n)
        return 0;
    return lseek(pe->fd, (off_t)pos, SEEK_SET) < 0 ? -1 : 0;
}

#define READ_OK 0
#define READ_ERROR (-1)         /* OSError, ValueError, OverflowError */
#define READ_NOMEM (-2)         /* MemoryError */

/* stream.seek(off); stream.read(size) */
static int py_read(const struct pyelf *pe, pint off, pint size, struct bytes *out)
{
    if (py_seek(pe, off) != 0)
        return READ_ERROR;
    if (size >= (pint)1 << 63)
        return READ_ERROR;
    if (size > mem_limit())
        return READ_NOMEM;                          /* read(n) allocates its n bytes first */
    pint avail = off >= (pint)pe->n ? 0 : (pint)pe->n - off;
    out->p = pe->d + (off >= (pint)pe->n ? pe->n : (size_t)off);
    out->n = (size_t)(size < avail ? size : avail);
    return READ_OK;
}

static uint16_t rd16(const unsigned char *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static uint32_t rd32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t rd64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* the ELF header fields pyelftools reads */
static struct {
    uint64_t shoff, phoff;
    unsigned shentsize, shnum, shstrndx, phentsize, phnum, machine;
    int shstr_ok;
    struct psec shstr;
} H;

/* _get_section_header(n): -1 where it raises */
static int shdr(const struct pyelf *pe, pint n, struct psec *s)
{
    if (H.shoff > 0 && H.shentsize < 64)
        return -1;                                  /* Too small e_shentsize */
    pint pos = (pint)H.shoff + n * H.shentsize;
    if (pos + 64 > (pint)pe->n)
        return -1;                                  /* past EOF, or a short read */
    const unsigned char *p = pe->d + (size_t)pos;
    memset(s, 0, sizeof(*s));
    s->name_off = rd32(p);
    s->type = rd32(p + 4);
    s->flags = rd64(p + 8);
    s->addr = rd64(p + 16);
    s->offset = rd64(p + 24);
    s->size = rd64(p + 32);
    s->link = rd32(p + 40);
    s->info = rd32(p + 44);
    s->align = rd64(p + 48);
    s->entsize = rd64(p + 56);
    s->name = (const unsigned char *)"";
    return 0;
}

/* Section.__init__: a compressed section's Elf64_Chdr is parsed */
static int section_init(const struct pyelf *pe, struct psec *s)
{
    if (!(s->flags & PY_SHF_COMPRESSED))
        return 0;
    if (py_seek(pe, s->offset) != 0 || (pint)s->offset + 24 > (pint)pe->n)
        return -1;
    s->ch_type = rd32(pe->d + s->offset);
    return 0;
}

/* ELFFile._section_header_stringtable (a cached_property) */
static int shstrtab(const struct pyelf *pe)
{
    if (H.shstr_ok)
        return 0;
    pint idx = H.shstrndx;
    if (H.shstrndx == 0xFFFF) {                     /* SHN_XINDEX: section 0's sh_link */
        struct psec z;
        if (shdr(pe, 0, &z) != 0)
            return -1;
        idx = z.link;
    }
    if (shdr(pe, idx, &H.shstr) != 0 || section_init(pe, &H.shstr) != 0)
        return -1;
    H.shstr_ok = 1;
    return 0;
}

/* StringTableSection.get_string: the bytes up to a NUL ("" without one).
 * Names are only compared with a few short ones: one longer than
 * NAME_MAX_LEN is read no further (NAME_OTHER), so that a file of many
 * sections named by one long string costs no more than one of short names. */
#define NAME_MAX_LEN 64
#define NAME_OTHER ((size_t)-1)
static int get_string(const struct pyelf *pe, const struct psec *tab, uint64_t off,
                      const unsigned char **s, size_t *len)
{
    pint pos = (pint)tab->offset + off;
    *s = (const unsigned char *)"";
    *len = 0;
    if (py_seek(pe, pos) != 0)
        return -1;
    if (pos >= (pint)pe->n)
        return 0;
    const unsigned char *p = pe->d + (size_t)pos;
    size_t avail = pe->n - (size_t)pos;
    const unsigned char *z = memchr(p, 0, avail < NAME_MAX_LEN + 1 ? avail : NAME_MAX_LEN + 1);
    if (z) {
        *s = p;
        *len = (size_t)(z - p);
    } else if (avail > NAME_MAX_LEN) {
        *len = NAME_OTHER;          /* a long name, or "" where no NUL follows: none of those looked for */
    }
    return 0;
}

static int make_section(const struct pyelf *pe, struct psec *s);

/* _get_linked_strtab_section / _get_linked_symtab_section */
static int linked(const struct pyelf *pe, uint32_t link, int symtab)
{
    struct psec l;
    if (shdr(pe, link, &l) != 0)
        return -1;
    if (symtab ? (l.type != PY_SHT_SYMTAB && l.type != PY_SHT_DYNSYM) : l.type != PY_SHT_STRTAB)
        return -1;
    return make_section(pe, &l);
}

/* ELFFile._make_section: -1 where building the section object raises */
static int make_section(const struct pyelf *pe, struct psec *s)
{
    if (shstrtab(pe) != 0 || get_string(pe, &H.shstr, s->name_off, &s->name, &s->name_len) != 0)
        return -1;
    if (section_init(pe, s) != 0)
        return -1;
    const unsigned char *p;
    pint end;
    switch (s->type) {
    case PY_SHT_SYMTAB:
    case PY_SHT_DYNSYM:
    case PY_SHT_SUNW_LDYNSYM:
        if (linked(pe, s->link, 0) != 0)
            return -1;
        return s->entsize > 0 && s->size % s->entsize == 0 ? 0 : -1;
    case PY_SHT_SUNW_SYMINFO:
    case PY_SHT_GNU_VERSYM:
        return linked(pe, s->link, 1);
    case PY_SHT_GNU_VERNEED:
    case PY_SHT_GNU_VERDEF:
        return linked(pe, s->link, 0);
    case PY_SHT_REL:
        return s->entsize == 16 ? 0 : -1;
    case PY_SHT_RELA:
        return s->entsize == 24 ? 0 : -1;
    case PY_SHT_RELR:
        return s->entsize == 8 ? 0 : -1;
    case PY_SHT_DYNAMIC: {
        struct psec l;                              /* get_section(link, (STRTAB, NOBITS, NULL)) */
        if (shdr(pe, s->link, &l) != 0)
            return -1;
        if (l.type != PY_SHT_STRTAB && l.type != PY_SHT_NOBITS && l.type != 0)
            return -1;
        return make_section(pe, &l);
    }
    case PY_SHT_HASH:                               /* ELFHashTable parses Elf_Hash */
        if (linked(pe, s->link, 1) != 0)
            return -1;
        if (s->size == 0)
            return 0;
        if (py_seek(pe, s->offset) != 0 || (pint)s->offset + 8 > (pint)pe->n)
            return -1;
        p = pe->d + s->offset;
        end = (pint)s->offset + 8 + 4 * ((pint)rd32(p) + rd32(p + 4));
        return end > (pint)pe->n ? -1 : 0;
    case PY_SHT_GNU_HASH:                           /* GNUHashTable parses Gnu_Hash */
        if (linked(pe, s->link, 1) != 0)
            return -1;
        if (py_seek(pe, s->offset) != 0 || (pint)s->offset + 16 > (pint)pe->n)
            return -1;
        p = pe->d + s->offset;
        end = (pint)s->offset + 16 + 8 * (pint)rd32(p + 8) + 4 * (pint)rd32(p);
        return end > (pint)pe->n ? -1 : 0;
    default:
        return 0;
    }
}

void pyelf_open(struct pyelf *pe, int fd)
{
    char err[128];
    memset(pe, 0, sizeof(*pe));
    memset(&H, 0, sizeof(H));
    /* elf_open_fd: ELF64 little-endian (pyelftools also reads ELF32 and
     * big-endian files: x32 objects are not read here) */
    if (elf_open_fd(&pe->f, fd, err, sizeof(err)) != 0)
        fail("%s", err);
    pe->fd = fd;
    pe->d = pe->f.data;
    pe->n = pe->f.size;
    const unsigned char *e = pe->d;
    H.machine = rd16(e + 18);
    H.phoff = rd64(e + 32);
    H.shoff = rd64(e + 40);
    H.phentsize = rd16(e + 54);
    H.phnum = rd16(e + 56);
    H.shentsize = rd16(e + 58);
    H.shnum = rd16(e + 60);
    H.shstrndx = rd16(e + 62);
    if (H.machine != EM_X86_64)
        fail("not x86_64 (e_machine %u)", H.machine);
    /* num_sections(), then every section as the name map makes them */
    pint count = 0;
    if (H.shoff != 0) {
        count = H.shnum;
        if (H.shnum == 0) {
            struct psec z;
            if (shdr(pe, 0, &z) != 0)
                fail("bad section header 0");
            count = z.size;
        }
    }
    size_t cap = 0;
    for (pint i = 0; i < count; i++) {
        struct psec s;
        if (shdr(pe, i, &s) != 0)
            fail("section header %llu past the end of the file", (unsigned long long)i);
        if (make_section(pe, &s) != 0)
            fail("malformed section %llu", (unsigned long long)i);
        if (pe->nsec == cap) {
            cap = grow(cap, pe->nsec + 1, sizeof(struct psec));
            pe->sec = xrealloc(pe->sec, cap * sizeof(struct psec));
        }
        pe->sec[pe->nsec++] = s;
    }
}

void pyelf_close(struct pyelf *pe)
{
    free(pe->sec);
    elf_close(&pe->f);
    memset(pe, 0, sizeof(*pe));
}

const struct psec *pyelf_by_name(const struct pyelf *pe, const char *name)
{
    size_t len = strlen(name);
    for (size_t i = pe->nsec; i-- > 0;)
        if (pe->sec[i].name_len == len && memcmp(pe->sec[i].name, name, len) == 0)
            return &pe->sec[i];
    return 0;
}

struct bytes pyelf_data(const struct pyelf *pe, const struct psec *s)
{
    struct bytes b = {0, 0};
    if (s->flags & PY_SHF_COMPRESSED) {
        /* not zlib: ELFCompressionError; zlib: pyelftools inflates it, this
         * program has no zlib */
        fail("compressed section (type %u)", s->ch_type);
    }
    int r = py_read(pe, s->offset, s->size, &b);
    if (r == READ_ERROR)
        fail("section data at %#llx: beyond what the file system allows", (unsigned long long)s->offset);
    if (r == READ_NOMEM)
        fail("section data of %#llx bytes: MemoryError", (unsigned long long)s->size);
    return b;
}

/* ------------------------------------------------------------------ */
/* prologue.function_symbols(path, ElfCache()): ElfCache.get(path,
 * symbols=True).function_symbols() */

#define ELF_OK 0
#define ELF_CAUGHT 1        /* an error of _PARSE_ERRORS: ElfCache.get is None, no symbols */
#define ELF_RAISES 2        /* another exception (MemoryError): function_symbols raises */

/* ElfFile._section_data */
static int elffile_section_data(const struct pyelf *pe, const struct psec *s, struct bytes *out)
{
    out->p = 0;
    out->n = 0;
    if (s->type == PY_SHT_NOBITS)
        return ELF_OK;
    if (s->flags & PY_SHF_COMPRESSED) {
        if (s->ch_type != 1)
            return ELF_CAUGHT;                      /* ELFCompressionError */
        fail("zlib-compressed symbol table");
    }
    int r = py_read(pe, s->offset, s->size, out);
    return r == READ_OK ? ELF_OK : r == READ_NOMEM ? ELF_RAISES : ELF_CAUGHT;
}

/* ElfFile(ident, stream): what it reads beyond the name map */
static int elffile_init(const struct pyelf *pe)
{
    pint nseg = H.phnum;
    if (H.phnum >= 0xFFFF) {                        /* PN_XNUM: get_section(0)['sh_info'] */
        struct psec z;
        if (shdr(pe, 0, &z) != 0 || make_section(pe, &z) != 0)
            return ELF_CAUGHT;
        nseg = z.info;
    }
    if (nseg > 0) {                                 /* iter_segments(): every header parsed */
        if (H.phoff > 0 && H.phentsize < 56)
            return ELF_CAUGHT;
        pint last = (pint)H.phoff + (nseg - 1) * H.phentsize;
        if (last + 56 > (pint)pe->n)
            return ELF_CAUGHT;
    }
    for (size_t i = 0; i < pe->nsec; i++) {
        const struct psec *s = &pe->sec[i];
        if (s->type == PY_SHT_NOBITS || s->name_len != 14 || memcmp(s->name, ".gnu_debuglink", 14) != 0)
            continue;
        if (s->flags & PY_SHF_COMPRESSED) {
            if (s->ch_type != 1)
                return ELF_CAUGHT;
            fail("zlib-compressed .gnu_debuglink");
        }
        struct bytes b;
        int r = py_read(pe, s->offset, s->size, &b);
        if (r != READ_OK)
            return r == READ_NOMEM ? ELF_RAISES : ELF_CAUGHT;
    }
    return ELF_OK;
}

/* elffile._decode_symbols + function_symbols: STT_FUNC, STT_GNU_IFUNC */
static void decode_symbols(struct bytes d, symvec *out)
{
    size_t usable = d.n - d.n % 24;
    for (size_t off = 0; off < usable; off += 24) {
        const unsigned char *p = d.p + off;
        uint32_t name = rd32(p);
        unsigned type = p[4] & 0xF;
        uint16_t shndx = rd16(p + 6);
        uint64_t value = rd64(p + 8), size = rd64(p + 16);
        if (shndx == 0 || !name || (value == 0 && type != 6 /* STT_TLS */))
            continue;
        if ((type == 2 || type == 10) && value) {
            struct sym s = {value, size};
            VPUSH(*out, s);
        }
    }
}

static int elfcache_symbols(const struct pyelf *pe, symvec *out)
{
    int r = elffile_init(pe);
    if (r != ELF_OK)
        return r;
    for (size_t i = 0; i < pe->nsec; i++) {
        const struct psec *s = &pe->sec[i];
        if (s->type != PY_SHT_SYMTAB && s->type != PY_SHT_DYNSYM)
            continue;
        if (s->link >= pe->nsec)
            return ELF_CAUGHT;                      /* IndexError */
        struct bytes strtab, data;
        if ((r = elffile_section_data(pe, &pe->sec[s->link], &strtab)) != ELF_OK)
            return r;
        if ((r = elffile_section_data(pe, s, &data)) != ELF_OK)
            return r;
        decode_symbols(data, out);
    }
    return ELF_OK;
}

/* derived_rows' own reading, with pyelftools: the STT_FUNC symbols of the
 * sections called .symtab and .dynsym (where function_symbols raised) */
static void pyelftools_symbols(const struct pyelf *pe, symvec *out)
{
    static const char *names[] = {".symtab", ".dynsym"};
    for (int k = 0; k < 2; k++) {
        const struct psec *s = pyelf_by_name(pe, names[k]);
        if (!s)
            continue;
        if (s->type == PY_SHT_GNU_VERSYM || s->type == PY_SHT_SUNW_SYMINFO) {
            /* iter_symbols of these yields entries without st_info (KeyError) */
            pint n = s->entsize ? (pint)(s->size / s->entsize) - (s->type == PY_SHT_SUNW_SYMINFO) : -1;
            if (n != 0)
                fail("%s is no symbol table", names[k]);
            continue;
        }
        if (s->type != PY_SHT_SYMTAB && s->type != PY_SHT_DYNSYM && s->type != PY_SHT_SUNW_LDYNSYM)
            continue;
        struct psec strtab;
        if (shdr(pe, s->link, &strtab) != 0)
            fail("bad string table");
        uint64_t count = s->size / s->entsize;
        for (uint64_t i = 0; i < count; i++) {
            pint pos = (pint)s->offset + (pint)i * s->entsize;
            if (py_seek(pe, pos) != 0 || pos + 24 > (pint)pe->n)
                fail("symbol %llu of %s past the end of the file", (unsigned long long)i, names[k]);
            const unsigned char *p = pe->d + (size_t)pos, *nm;
            size_t len;
            if (get_string(pe, &strtab, rd32(p), &nm, &len) != 0)
                fail("symbol name beyond what the file system allows");
            uint64_t value = rd64(p + 8), size = rd64(p + 16);
            if ((p[4] & 0xF) == 2 && value && rd16(p + 6) != 0) {
                struct sym sy = {value, size};
                VPUSH(*out, sy);
            }
        }
    }
}

int pyelf_function_symbols(struct pyelf *pe, symvec *out)
{
    out->n = 0;
    int r = elfcache_symbols(pe, out);
    if (r == ELF_OK)
        return 0;
    out->n = 0;
    if (r == ELF_CAUGHT)
        return 0;                                   /* ElfCache.get gave None: [] */
    pyelftools_symbols(pe, out);                    /* syms=None */
    return 1;
}

size_t bisect_right(const pint *a, size_t n, pint x)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (x < a[mid])
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

size_t bisect_left(const pint *a, size_t n, pint x)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (a[mid] < x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}
