/* The `table` command's parts (tables.c, tables_elf.c, ehframe.c,
 * prologue.c): the unwind table of tests/reference/unwind_table.py, byte
 * for byte.  The Python is the reference; these files follow its
 * functions one by one, and say where they do what its libraries
 * (pyelftools, struct, the capstone binding, int()) do for it.
 *
 * Numbers are Python ints there: `pint` here, an __int128 that saturates
 * at +-PBIG.  Every value the table depends on is far inside that (file
 * offsets and addresses, < 2^66); only LEB128 numbers of a crafted file
 * reach it, and beyond it they compare as "huge" (tables.c lists where
 * this program and the Python part). */
#ifndef PYOFFCPU_HELPER_TABLES_H
#define PYOFFCPU_HELPER_TABLES_H

#include <stddef.h>
#include <stdint.h>

#include "elf.h"

/* The row kinds and limits: bpf/unwind_defs.h, included (the one source
 * bpfdefs.py reads too; it needs struct stack_key from bpf/pyoffcpu.h). */
#define PYOFFCPU_USER_SPACE 1      /* its constants and structs, not its BPF code */
#include "../../../../bpf/pyoffcpu.h"
#include "../../../../bpf/unwind_defs.h"

/* The functions of these files have names of their own at link time
 * (symbols.c and others are linked into the same program). */
#define fail tables_fail
#define xmalloc tables_xmalloc
#define xcalloc tables_xcalloc
#define xrealloc tables_xrealloc
#define grow tables_grow
#define bisect_left tables_bisect_left
#define bisect_right tables_bisect_right
#define entries_add tables_entries_add
#define py_int tables_py_int
#define read_sleb_bytes tables_read_sleb_bytes
#define sort_pints tables_sort_pints
#define sort_spans tables_sort_spans
#define derived_rows tables_derived_rows

typedef __int128 pint;
#define PBIG ((pint)1 << 120)
#define U64_END ((pint)1 << 64)

static inline pint psat(pint v) { return v > PBIG ? PBIG : v < -PBIG ? -PBIG : v; }
static inline pint padd(pint a, pint b) { return psat(psat(a) + psat(b)); }
static inline pint pabs(pint a) { return a < 0 ? -a : a; }
static inline pint pmul(pint a, pint b)
{
    a = psat(a);
    b = psat(b);
    if (a == 0 || b == 0)
        return 0;
    int neg = (a < 0) != (b < 0);
    if (pabs(a) > PBIG / pabs(b))
        return neg ? -PBIG : PBIG;
    return a * b;
}
/* Python's floor division and modulo by a positive constant */
static inline int64_t floordiv(int64_t a, int64_t b)
{
    int64_t q = a / b;
    return (a % b != 0 && a < 0) ? q - 1 : q;
}

/* One line on stderr, exit 1: where the Python raises, and for what this
 * program refuses (caps, formats it cannot read). */
__attribute__((noreturn, format(printf, 1, 2))) void fail(const char *fmt, ...);

/* Allocation: fails (exit 1) past the cap or when memory runs out. */
#define ALLOC_CAP ((size_t)3 << 30)
void *xmalloc(size_t n);
void *xcalloc(size_t n, size_t size);
void *xrealloc(void *p, size_t n);
size_t grow(size_t cap, size_t need, size_t elem);

#define VEC(T) struct { T *v; size_t n, cap; }
#define VRESERVE(vec, need) do { \
        if ((need) > (vec).cap) { \
            (vec).cap = grow((vec).cap, (need), sizeof(*(vec).v)); \
            (vec).v = xrealloc((vec).v, (vec).cap * sizeof(*(vec).v)); \
        } } while (0)
#define VPUSH(vec, x) do { VRESERVE(vec, (vec).n + 1); (vec).v[(vec).n++] = (x); } while (0)
#define VFREE(vec) do { free((vec).v); (vec).v = 0; (vec).n = (vec).cap = 0; } while (0)

/* ------------------------------------------------------------------ */
/* The ELF file as pyelftools sees it (tables_elf.c)                   */

#define PY_SHT_PROGBITS 1
#define PY_SHT_SYMTAB 2
#define PY_SHT_STRTAB 3
#define PY_SHT_RELA 4
#define PY_SHT_HASH 5
#define PY_SHT_DYNAMIC 6
#define PY_SHT_NOBITS 8
#define PY_SHT_REL 9
#define PY_SHT_DYNSYM 11
#define PY_SHT_RELR 0x13
#define PY_SHT_SUNW_LDYNSYM 0x6ffffff3
#define PY_SHT_GNU_HASH 0x6ffffff6
#define PY_SHT_SUNW_SYMINFO 0x6ffffffc
#define PY_SHT_GNU_VERDEF 0x6ffffffd
#define PY_SHT_GNU_VERNEED 0x6ffffffe
#define PY_SHT_GNU_VERSYM 0x6fffffff
#define PY_SHF_EXECINSTR 0x4
#define PY_SHF_COMPRESSED 0x800

struct psec {
    uint32_t name_off, type, link, info;
    uint64_t flags, addr, offset, size, align, entsize;
    uint32_t ch_type;               /* compressed: Elf64_Chdr.ch_type */
    const unsigned char *name;      /* pyelftools' name (get_string): bytes up to the NUL */
    size_t name_len;
};

struct pyelf {
    struct elf_file f;
    int fd;
    const unsigned char *d;         /* the whole file */
    size_t n;
    struct psec *sec;               /* iter_sections(), in order */
    size_t nsec;
};

/* A bytes object of the Python side: data, length. */
struct bytes {
    const unsigned char *p;
    size_t n;
};

/* ELFFile(stream), e_machine == EM_X86_64, and the section name map
 * (every section made once, as get_section_by_name does): fails as
 * pyelftools raises. */
void pyelf_open(struct pyelf *pe, int fd);
void pyelf_close(struct pyelf *pe);
/* get_section_by_name: the last section of that name (a dict), or 0 */
const struct psec *pyelf_by_name(const struct pyelf *pe, const char *name);
/* Section.data() (not SHT_NOBITS): fails where it raises */
struct bytes pyelf_data(const struct pyelf *pe, const struct psec *s);

struct sym {
    uint64_t value, size;
};
typedef VEC(struct sym) symvec;
/* table_from_elf's `syms`: prologue.function_symbols() through a new
 * ElfCache, or, where that raises, derived_rows' own reading (returns 1:
 * those are the STT_FUNC symbols of .symtab and .dynsym) */
int pyelf_function_symbols(struct pyelf *pe, symvec *out);

/* Python's bisect on a pint array */
size_t bisect_right(const pint *a, size_t n, pint x);
size_t bisect_left(const pint *a, size_t n, pint x);

/* ------------------------------------------------------------------ */
/* Table entries (build_table's (loc, priority, encoding))            */

/* An encoding (kind, cfa_off, rbp) packed: kind in bits 0-7, cfa_off in
 * 8-23, rbp in 24-31; ENC_BAD: one whose cfa_off or rbp does not fit
 * struct unwind_row (ROW.pack raises on it). */
#define ENC(kind, cfa, rbp) ((uint32_t)(uint8_t)(kind) | (uint32_t)(uint16_t)(int16_t)(cfa) << 8 | \
                             (uint32_t)(uint8_t)(int8_t)(rbp) << 24)
#define ENC_BAD 0x000000FFu
#define ENC_KIND(e) ((e) & 0xFF)

struct entry {
    uint64_t loc;
    uint32_t enc;
    uint32_t prio;                  /* 0, 1 */
};
struct hentry {                     /* an entry at a loc outside [0, 2^64) */
    pint loc;
    uint32_t enc, prio;
    uint64_t seq;
};

struct entries {
    VEC(struct entry) e;
    VEC(struct hentry) high;
    uint64_t nseq;
    int negative;                   /* some loc < 0: serialize raises */
};
void entries_add(struct entries *es, pint loc, uint32_t prio, uint32_t enc);

/* ------------------------------------------------------------------ */
/* .eh_frame (ehframe.c)                                              */

struct span {
    pint begin, end;
};
typedef VEC(struct span) spanvec;

/* parse_eh_frame + the FDE part of build_table: every FDE's rows and end
 * into es (after the derived ones), its (pc_begin, pc_end) into spans;
 * the unsupported count. */
uint64_t ehframe_entries(struct bytes data, uint64_t section_addr, struct entries *es, spanvec *spans);

/* read_sleb of table.py's _plt_threshold/_drap_offset */
int read_sleb_bytes(struct bytes b, pint pos, pint *val, pint *npos);

/* ------------------------------------------------------------------ */
/* Prologue analysis (prologue.c)                                     */

/* derived_rows(): the rows, in order, into es */
void derived_rows(struct pyelf *pe, const spanvec *fde_spans, const symvec *syms, struct entries *es);

/* int(text, 0) of ASCII text: 1 with *v (saturated), 0 where it raises */
int py_int(const char *s, size_t n, pint *v);

/* sorting (tables.c) */
void sort_pints(pint *a, size_t n);
void sort_spans(struct span *a, size_t n);

#endif
