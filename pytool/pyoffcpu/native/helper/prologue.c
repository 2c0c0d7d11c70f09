/* Prologue analysis: tests/reference/prologue.py's derived_rows, rule for rule.
 *
 * The analysis reads capstone's Intel-syntax text (mnemonic, operands)
 * with Python's string tests; each instruction's text is read once, when
 * it is decoded, into the facts those tests give (struct desc), and the
 * traversal works on them.  Decoding is capstone's, the same library the
 * Python binding loads (libcapstone.so beside it: pyoffcpu starts this
 * program with LD_LIBRARY_PATH there; a wheel's RUNPATH finds it too), with the same handle options (x86-64, Intel syntax,
 * no detail, no skipdata): _Decoder decodes runs of up to 64 instructions
 * from up to 1024 bytes; an instruction decodes the same whatever run it
 * is part of, so here each is decoded alone, from the same bytes.
 *
 * Per region (a function, functions that overlap, a gap) its bytes are
 * indexed by offset: the decoded instruction, the rule before it (the
 * Python's dicts); the traversal's work list is the Python's stack, in
 * its order (the rules it finds depend on it). */
#include "tables.h"

#include <capstone/capstone.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_FUNCTION_BYTES (1 << 20)
#define MAX_GAP_BYTES (16 << 20)
#define MIN_GAP_BYTES 16
#define PROLOGUE_MAX 24
#define MAX_RUN_BYTES 1024                  /* 16 * MAX_RUN */
#define MAX_GAP_STEPS ((uint64_t)1 << 28)  /* code_gaps' loop: about once per FDE and symbol */
#define SCAN_CHUNK ((size_t)24 << 20)     /* bytes read before they are given back (24: a relocation's) */

/* ------------------------------------------------------------------ */
/* capstone                                                            */

static struct {
    cs_err (*open)(cs_arch, cs_mode, csh *);
    cs_insn *(*malloc_insn)(csh);
    bool (*disasm_iter)(csh, const uint8_t **, size_t *, uint64_t *, cs_insn *);
    unsigned (*version)(int *, int *);
    csh h;
    cs_insn *insn;
    int loaded;
} CS;

/* The library is opened here rather than linked: the wheel ships
 * libcapstone.so alone, whose SONAME (libcapstone.so.5) a linked program
 * would look for and not find.  dlopen searches LD_LIBRARY_PATH (set by
 * pyoffcpu to its Python's capstone/lib), then this program's RUNPATH (the
 * Makefile's -rpath: where pip puts capstone/lib beside pyoffcpu). */
static void capstone_load(void)
{
    if (CS.loaded)
        return;
    void *lib = dlopen("libcapstone.so", RTLD_NOW | RTLD_LOCAL);
    if (!lib)
        lib = dlopen("libcapstone.so.5", RTLD_NOW | RTLD_LOCAL);
    if (!lib)
        fail("capstone not found (%s)", dlerror());
    *(void **)&CS.open = dlsym(lib, "cs_open");
    *(void **)&CS.malloc_insn = dlsym(lib, "cs_malloc");
    *(void **)&CS.disasm_iter = dlsym(lib, "cs_disasm_iter");
    *(void **)&CS.version = dlsym(lib, "cs_version");
    if (!CS.open || !CS.malloc_insn || !CS.disasm_iter || !CS.version)
        fail("capstone without cs_disasm_iter");
    int major, minor;
    CS.version(&major, &minor);
    if (major != CS_API_MAJOR || minor != CS_API_MINOR)      /* as the binding checks */
        fail("capstone %d.%d, built for %d.%d", major, minor, CS_API_MAJOR, CS_API_MINOR);
    /* capstone.Cs(CS_ARCH_X86, CS_MODE_64): no option is set */
    if (CS.open(CS_ARCH_X86, CS_MODE_64, &CS.h) != CS_ERR_OK)
        fail("cs_open failed");
    CS.insn = CS.malloc_insn(CS.h);
    if (!CS.insn)
        fail("cs_malloc failed");
    CS.loaded = 1;
}

/* ------------------------------------------------------------------ */
/* Python's str and int on capstone's ASCII text                       */

struct str {
    const char *p;
    size_t n;
};

static struct str sub(struct str s, size_t from) { if (from > s.n) from = s.n; struct str r = {s.p + from, s.n - from}; return r; }
static int eq(struct str s, const char *lit) { size_t n = strlen(lit); return s.n == n && memcmp(s.p, lit, n) == 0; }
static int starts(struct str s, const char *lit) { size_t n = strlen(lit); return s.n >= n && memcmp(s.p, lit, n) == 0; }
static int ends(struct str s, const char *lit) { size_t n = strlen(lit); return s.n >= n && memcmp(s.p + s.n - n, lit, n) == 0; }

struct lit {
    const char *s;
    size_t n;
};
#define L(x) {x, sizeof(x) - 1}

static int in_set(struct str s, const struct lit *set)
{
    for (; set->s; set++)
        if (s.n == set->n && memcmp(s.p, set->s, s.n) == 0)
            return 1;
    return 0;
}

/* str.isspace() of an ASCII character (str.strip(), str.split()) */
static int str_space(unsigned char c) { return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20); }
/* Py_ISSPACE: what int() skips */
static int int_space(unsigned char c) { return c == ' ' || (c >= 0x09 && c <= 0x0D); }

static struct str strip(struct str s)
{
    while (s.n && str_space((unsigned char)s.p[0])) {
        s.p++;
        s.n--;
    }
    while (s.n && str_space((unsigned char)s.p[s.n - 1]))
        s.n--;
    return s;
}

/* s.strip(chars) */
static struct str strip_chars(struct str s, const char *chars)
{
    while (s.n && strchr(chars, s.p[0])) {
        s.p++;
        s.n--;
    }
    while (s.n && strchr(chars, s.p[s.n - 1]))
        s.n--;
    return s;
}

static int digit_value(unsigned char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'z')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'Z')
        return c - 'A' + 10;
    return 99;
}

/* int(text, 0) (CPython's PyLong_FromString with base 0) */
int py_int(const char *s, size_t n, pint *out)
{
    size_t i = 0;
    int sign = 1, base = 10, error_if_nonzero = 0;
    while (i < n && int_space((unsigned char)s[i]))
        i++;
    if (i < n && s[i] == '+')
        i++;
    else if (i < n && s[i] == '-') {
        i++;
        sign = -1;
    }
    char c0 = i < n ? s[i] : 0, c1 = i + 1 < n ? s[i + 1] : 0;
    if (c0 != '0')
        base = 10;
    else if (c1 == 'x' || c1 == 'X')
        base = 16;
    else if (c1 == 'o' || c1 == 'O')
        base = 8;
    else if (c1 == 'b' || c1 == 'B')
        base = 2;
    else
        error_if_nonzero = 1;
    if (base != 10) {
        i += 2;
        if (i < n && s[i] == '_')
            i++;                        /* one underscore allowed after the prefix */
    }
    if (i < n && s[i] == '_')
        return 0;
    pint v = 0;
    size_t digits = 0;
    char prev = 0;
    for (; i < n; i++) {
        char c = s[i];
        if (c == '_') {
            if (prev == '_')
                return 0;
        } else {
            int d = digit_value((unsigned char)c);
            if (d >= base)
                break;
            digits++;
            v = psat(v * base + d);
        }
        prev = c;
    }
    if (prev == '_' || digits == 0)
        return 0;
    if (error_if_nonzero && v != 0)
        return 0;
    while (i < n && int_space((unsigned char)s[i]))
        i++;
    if (i != n)
        return 0;
    *out = sign * v;
    return 1;
}

static int str_int(struct str s, pint *v) { return py_int(s.p, s.n, v); }

/* ------------------------------------------------------------------ */
/* What prologue.py's tests say of one instruction                     */

static const struct lit IMPLICIT_RSP[] = {L("push"), L("pushfq"), L("pushf"), L("pop"), L("popfq"), L("popf"),
                                         L("leave"), L("enter"), L("ret"), L("retf"), L("iretq"), L("iret"),
                                         L("iretd"), {0, 0}};
static const struct lit EXCHANGES[] = {L("xchg"), L("xadd"), L("cmpxchg"), {0, 0}};
static const struct lit RSP_NAMES[] = {L("rsp"), L("esp"), L("sp"), L("spl"), {0, 0}};
static const struct lit RBP_NAMES[] = {L("rbp"), L("ebp"), L("bp"), L("bpl"), {0, 0}};
static const struct lit RBX_NAMES[] = {L("rbx"), L("ebx"), L("bx"), L("bl"), L("bh"), {0, 0}};
static const struct lit RBX_IMPLICIT[] = {L("cpuid"), {0, 0}};
static const struct lit ENDS[] = {L("ret"), L("retf"), L("leave"), L("iretq"), L("iret"), L("iretd"), L("jmp"),
                                  L("ljmp"), L("ud2"), L("hlt"), {0, 0}};
static const struct lit GPRS[] = {L("rax"), L("rbx"), L("rcx"), L("rdx"), L("rsi"), L("rdi"), L("rbp"), L("rsp"),
                                  L("r8"), L("r9"), L("r10"), L("r11"), L("r12"), L("r13"), L("r14"), L("r15"),
                                  {0, 0}};
static const struct lit SPECIAL_PREFIXES[] = {L("call"), L("loop"), L("iret"), L("push"), L("pop"), L("xchg"),
                                              L("xadd"), L("cmpxchg"), {0, 0}};

static int starts_any(struct str s, const struct lit *set)
{
    for (; set->s; set++)
        if (s.n >= set->n && memcmp(s.p, set->s, set->n) == 0)
            return 1;
    return 0;
}

/* ops[:2] in _MAYBE_FRAME_REG: rs es sp rb eb bp bx bl bh */
static int maybe_frame_reg(struct str ops)
{
    if (ops.n < 2)
        return 0;
    char b = ops.p[1];
    switch (ops.p[0]) {
    case 'r':
    case 'e':
        return b == 's' || b == 'b';
    case 's':
        return b == 'p';
    case 'b':
        return b == 'p' || b == 'x' || b == 'l' || b == 'h';
    default:
        return 0;
    }
}

/* Could m be in one of the sets or start with one of the prefixes the
 * tests name?  (Their first letters: a quick no for most mnemonics.) */
static int notable(struct str m)
{
    if (!m.n)
        return 1;
    switch (m.p[0]) {
    case 'c': case 'e': case 'h': case 'i': case 'j': case 'l': case 'p': case 'r': case 'u': case 'x':
        return 1;
    default:
        return 0;
    }
}

static int special(struct str m)      /* m in _SPECIAL */
{
    return in_set(m, IMPLICIT_RSP) || in_set(m, ENDS) || in_set(m, RBX_IMPLICIT);
}

/* _writes(m, ops, names) */
static int writes(struct str m, struct str ops, const struct lit *names)
{
    struct str first = ops;
    const char *comma = memchr(ops.p, ',', ops.n);
    if (comma)
        first.n = (size_t)(comma - ops.p);
    if (in_set(strip(first), names))
        return 1;
    if (starts_any(m, EXCHANGES)) {
        /* ops.replace(",", " ").split(): tokens between whitespace and commas */
        size_t i = 0;
        while (i < ops.n) {
            while (i < ops.n && (str_space((unsigned char)ops.p[i]) || ops.p[i] == ','))
                i++;
            size_t j = i;
            while (j < ops.n && !(str_space((unsigned char)ops.p[j]) || ops.p[j] == ','))
                j++;
            if (j > i) {
                struct str tok = {ops.p + i, j - i};
                if (in_set(strip_chars(tok, " []"), names))
                    return 1;
            }
            i = j;
        }
    }
    return 0;
}

/* _frame_slot's text part: 1 with x for `mov qword ptr [rsp + X], rbp`
 * (load: `mov rbp, qword ptr [rsp + X]`), X >= 0 and a multiple of 8;
 * the test against the frame's size is the caller's */
static int frame_slot_rbp(struct str m, struct str ops, int load, int64_t *x)
{
    if (!eq(m, "mov"))
        return 0;
    struct str before = ops, after = {ops.p + ops.n, 0};
    for (size_t i = 0; i + 1 < ops.n; i++)
        if (ops.p[i] == ',' && ops.p[i + 1] == ' ') {
            before.n = i;
            after.p = ops.p + i + 2;
            after.n = ops.n - i - 2;
            break;
        }
    struct str reg = load ? before : after, where = load ? after : before;
    if (!in_set(reg, GPRS) || !starts(where, "qword ptr [rsp") || !ends(where, "]"))
        return 0;
    if (!eq(reg, "rbp"))
        return 0;                       /* a slot of another register: not used */
    /* where[len("qword ptr [rsp"):-1].replace(" ", "") */
    char buf[256];
    size_t n = 0;
    for (size_t i = 14; i + 1 < where.n && n < sizeof(buf); i++)
        if (where.p[i] != ' ')
            buf[n++] = where.p[i];
    pint v;
    if (n == 0)
        v = 0;
    else if (buf[0] == '+' && py_int(buf, n, &v))
        ;
    else
        return 0;
    if (v < 0 || v % 8)
        return 0;
    *x = v > ((pint)1 << 62) ? (int64_t)1 << 62 : (int64_t)v;
    return 1;
}

enum {
    D_JLOOP = 1 << 0,       /* m.startswith(("j", "loop")) */
    D_CALL = 1 << 1,        /* m.startswith("call") */
    D_RET = 1 << 2,         /* m.startswith("ret") */
    D_JMP = 1 << 3,         /* m == "jmp" */
    D_ENDS = 1 << 4,        /* m in ENDS */
    D_LEAVE = 1 << 5,
    D_PUSH = 1 << 6,
    D_PUSH_RBP = 1 << 7,    /* push and ops == "rbp" */
    D_PUSHF = 1 << 8,
    D_POPF = 1 << 9,
    D_POP = 1 << 10,
    D_OPS_RBP = 1 << 11,    /* ops in RBP_NAMES */
    D_OPS_RSP = 1 << 12,
    D_OPS_RBX = 1 << 13,
    D_ADDSUB = 1 << 14,     /* m in (sub, add) and ops.startswith("rsp, ") */
    D_SUB = 1 << 15,
    D_ADDSUB_IMM = 1 << 16, /* ... with an immediate (addsub) */
    D_LEA = 1 << 17,        /* lea and ops.startswith("rsp, [rsp") */
    D_LEA_DISP = 1 << 18,   /* ... with its displacement (disp) */
    D_LOAD_RBP = 1 << 19,   /* mov rbp, qword ptr [rsp + X] (load_x) */
    D_STORE_RBP = 1 << 20,  /* mov qword ptr [rsp + X], rbp (store_x) */
    D_MOV_RBP_RSP = 1 << 21,
    D_MOV_RBX_RSP = 1 << 22,
    D_MOV_RSP_RBP = 1 << 23,
    D_MOV_RSP_RBX = 1 << 24,
    D_IMPLICIT_RSP = 1 << 25,
    D_W_RSP = 1 << 26,      /* _writes(m, ops, RSP_NAMES) */
    D_W_RBP = 1 << 27,
    D_W_RBX = 1 << 28,
    D_ENTER = 1 << 29,
    D_RBX_IMPLICIT = 1 << 30,
};

struct desc {
    pint target;            /* _int(ops.strip()) */
    int64_t addsub, disp, load_x, store_x;
    uint32_t f;
    int has_target;
};

static void describe(struct str m, struct str ops, struct desc *d)
{
    memset(d, 0, sizeof(*d));
    uint32_t f = 0;
    pint v;
    d->has_target = str_int(strip(ops), &d->target);
    if (starts(m, "j") || starts(m, "loop"))
        f |= D_JLOOP;
    if (starts(m, "call"))
        f |= D_CALL;
    if (starts(m, "ret"))
        f |= D_RET;
    if (eq(m, "jmp"))
        f |= D_JMP;
    if (in_set(m, ENDS))
        f |= D_ENDS;
    if (eq(m, "leave"))
        f |= D_LEAVE;
    if (eq(m, "push")) {
        f |= D_PUSH;
        if (eq(ops, "rbp"))
            f |= D_PUSH_RBP;
    }
    if (eq(m, "pushfq") || eq(m, "pushf"))
        f |= D_PUSHF;
    if (eq(m, "popfq") || eq(m, "popf"))
        f |= D_POPF;
    if (eq(m, "pop"))
        f |= D_POP;
    if (in_set(ops, RBP_NAMES))
        f |= D_OPS_RBP;
    if (in_set(ops, RSP_NAMES))
        f |= D_OPS_RSP;
    if (in_set(ops, RBX_NAMES))
        f |= D_OPS_RBX;
    if ((eq(m, "sub") || eq(m, "add")) && starts(ops, "rsp, ")) {
        f |= D_ADDSUB | (eq(m, "sub") ? D_SUB : 0);
        if (str_int(strip(sub(ops, 5)), &v)) {
            f |= D_ADDSUB_IMM;
            d->addsub = (int64_t)(v > ((pint)1 << 62) ? (pint)1 << 62 : v < -((pint)1 << 62) ? -((pint)1 << 62) : v);
        }
    }
    if (eq(m, "lea") && starts(ops, "rsp, [rsp")) {
        f |= D_LEA;
        struct str rest = strip(sub(ops, 9));
        int ok = 0;
        if (eq(rest, "]")) {
            v = 0;
            ok = 1;
        } else if (ends(rest, "]")) {
            char buf[256];
            size_t n = 0;
            for (size_t i = 0; i + 1 < rest.n && n < sizeof(buf); i++)
                if (rest.p[i] != ' ')
                    buf[n++] = rest.p[i];
            ok = py_int(buf, n, &v);
        }
        if (ok) {
            f |= D_LEA_DISP;
            d->disp = (int64_t)(v > ((pint)1 << 62) ? (pint)1 << 62 : v < -((pint)1 << 62) ? -((pint)1 << 62) : v);
        }
    }
    if (frame_slot_rbp(m, ops, 1, &d->load_x))
        f |= D_LOAD_RBP;
    if (frame_slot_rbp(m, ops, 0, &d->store_x))
        f |= D_STORE_RBP;
    if (eq(m, "mov")) {
        if (eq(ops, "rbp, rsp"))
            f |= D_MOV_RBP_RSP;
        if (eq(ops, "rbx, rsp"))
            f |= D_MOV_RBX_RSP;
        if (eq(ops, "rsp, rbp"))
            f |= D_MOV_RSP_RBP;
        if (eq(ops, "rsp, rbx"))
            f |= D_MOV_RSP_RBX;
    }
    if (in_set(m, IMPLICIT_RSP))
        f |= D_IMPLICIT_RSP;
    if (writes(m, ops, RSP_NAMES))
        f |= D_W_RSP;
    if (writes(m, ops, RBP_NAMES))
        f |= D_W_RBP;
    if (writes(m, ops, RBX_NAMES))
        f |= D_W_RBX;
    if (eq(m, "enter"))
        f |= D_ENTER;
    if (in_set(m, RBX_IMPLICIT))
        f |= D_RBX_IMPLICIT;
    d->f = f;
}

/* ------------------------------------------------------------------ */
/* A region's decoded instructions (_Decoder) and rules                */

/* info[off]: 0 not decoded yet; INFO_NONE: no instruction (at() is None) */
#define I_SIZE 0x0Fu
#define I_FAST 0x10u        /* the fast path takes it (outside the prologue) */
#define I_ENDRET 0x20u      /* m in ENDS or m.startswith("ret") (_stays_inside) */
#define I_PSTOP 0x40u       /* m.startswith(("j", "call", "loop")) or m in ENDS (_prologue) */
#define I_RAISES 0x80u      /* the fast test raises (m == "": m[0]) */
#define INFO_NONE 0xF0u
#define I_DESC_SHIFT 32

/* a rule (kind, cfa_off, rbp) packed; 0: none yet */
typedef uint64_t rule_t;
#define CONFLICT ((rule_t)(1 | 7 << 1))
#define RBP_BIAS ((int64_t)1 << 27)

static rule_t pack(int kind, int64_t cfa, int64_t rbp)
{
    if (cfa < 0 || cfa >= (int64_t)1 << 30 || rbp < -RBP_BIAS || rbp >= RBP_BIAS)
        fail("prologue: a frame of %lld bytes", (long long)cfa);
    return 1 | (rule_t)kind << 1 | (rule_t)cfa << 4 | (rule_t)(rbp + RBP_BIAS) << 34;
}
static int rkind(rule_t r) { return (int)(r >> 1 & 7); }
static int64_t rcfa(rule_t r) { return (int64_t)(r >> 4 & (((rule_t)1 << 30) - 1)); }
static int64_t rrbp(rule_t r) { return (int64_t)(r >> 34 & (((rule_t)1 << 28) - 1)) - RBP_BIAS; }

struct region {
    pint start, end;            /* the code: [start, end) */
    const unsigned char *code;
    size_t len;
    uint64_t *info;             /* per offset */
    rule_t *state;              /* per offset: the rule before it */
    unsigned char *prol;        /* per offset: in the prologue */
    size_t cap;                 /* of the three */
    VEC(uint32_t) decoded, touched, marks, work;
    VEC(struct desc) descs;
    /* the traversal's findings */
    int conflict;               /* CONFLICT in state.values() */
    size_t nexits;
    int bad_exit;               /* an exit not at CFA = rsp + 8 */
};

static struct region R;

static void region_begin(pint start, struct bytes code)
{
    R.start = start;
    R.end = start + (pint)code.n;
    R.code = code.p;
    R.len = code.n;
    if (code.n > UINT32_MAX / 2)
        fail("a region of code of %zu bytes", code.n);     /* offsets are 32-bit */
    if (code.n > R.cap) {
        free(R.info);
        free(R.state);
        free(R.prol);
        R.cap = code.n;
        R.info = xcalloc(R.cap, sizeof(*R.info));
        R.state = xcalloc(R.cap, sizeof(*R.state));
        R.prol = xcalloc(R.cap, 1);
    }
    R.descs.n = 0;
}

static void reset_states(void)
{
    for (size_t i = 0; i < R.touched.n; i++)
        R.state[R.touched.v[i]] = 0;
    R.touched.n = 0;
    R.work.n = 0;
    R.conflict = 0;
    R.nexits = 0;
    R.bad_exit = 0;
}

static void reset_marks(void)
{
    for (size_t i = 0; i < R.marks.n; i++)
        R.prol[R.marks.v[i]] = 0;
    R.marks.n = 0;
}

static void region_end(void)
{
    reset_states();
    reset_marks();
    for (size_t i = 0; i < R.decoded.n; i++)
        R.info[R.decoded.v[i]] = 0;
    R.decoded.n = 0;
    R.descs.n = 0;
}

/* capstone at code offset off: the instruction, or 0 */
static const cs_insn *decode_insn(size_t off)
{
    pint addr = R.start + (pint)off;
    if (addr >= U64_END)
        return 0;                       /* the binding's addresses wrap at 2^64: never found */
    const uint8_t *p = R.code + off;
    size_t n = R.len - off < MAX_RUN_BYTES ? R.len - off : MAX_RUN_BYTES;
    uint64_t a = (uint64_t)addr;
    if (!CS.disasm_iter(CS.h, &p, &n, &a, CS.insn))
        return 0;
    return CS.insn;
}

/* a capstone string: its length; the binding decodes it as ASCII (and
 * raises on another byte) */
static struct str ascii(const char *s)
{
    unsigned char any = 0;
    size_t n = 0;
    while (s[n])
        any |= (unsigned char)s[n++];
    if (any & 0x80)
        fail("non-ASCII instruction text");
    struct str r = {s, n};
    return r;
}

static uint64_t add_desc(const cs_insn *in)
{
    struct desc d;
    describe(ascii(in->mnemonic), ascii(in->op_str), &d);
    VPUSH(R.descs, d);
    return (uint64_t)R.descs.n << I_DESC_SHIFT;
}

static uint64_t decode(size_t off)
{
    const cs_insn *in = decode_insn(off);
    uint64_t info = INFO_NONE;
    if (in) {
        struct str m = ascii(in->mnemonic), ops = ascii(in->op_str);
        info = in->size & I_SIZE;
        if (!notable(m)) {
            if (!maybe_frame_reg(ops))
                info |= I_FAST;
        } else {
            int ends = in_set(m, ENDS);
            if (!maybe_frame_reg(ops) && !special(m)) {
                if (m.n == 0)
                    info |= I_RAISES;
                else if (m.p[0] != 'j' && !starts_any(m, SPECIAL_PREFIXES))
                    info |= I_FAST;
            }
            if (ends || starts(m, "ret"))
                info |= I_ENDRET;
            if (ends || starts(m, "j") || starts(m, "call") || starts(m, "loop"))
                info |= I_PSTOP;
        }
        if (!(info & I_FAST))
            info |= add_desc(in);
    }
    R.info[off] = info;
    VPUSH(R.decoded, (uint32_t)off);
    return info;
}

/* dec.at(addr): the instruction's info, or 0 (None) */
static inline uint64_t at(pint addr)
{
    pint off = addr - R.start;
    if (off < 0 || off >= (pint)R.len)
        return 0;
    uint64_t i = R.info[(size_t)off];
    if (!i)
        i = decode((size_t)off);
    return i == INFO_NONE ? 0 : i;
}

static const struct desc *desc_of(size_t off)
{
    uint64_t i = R.info[off];
    if (!(i >> I_DESC_SHIFT)) {
        const cs_insn *in = decode_insn(off);
        if (!in)
            fail("prologue: an instruction decodes once only");
        R.info[off] = i | add_desc(in);
        i = R.info[off];
    }
    return &R.descs.v[(i >> I_DESC_SHIFT) - 1];
}

/* _prologue(dec, entries): the marks */
static void mark_prologue(const pint *entries, size_t n)
{
    for (size_t k = 0; k < n; k++) {
        pint addr = entries[k];
        for (int s = 0; s < PROLOGUE_MAX; s++) {
            uint64_t got = at(addr);
            if (!got || (got & I_PSTOP))
                break;
            size_t off = (size_t)(addr - R.start);
            if (!R.prol[off]) {
                R.prol[off] = 1;
                VPUSH(R.marks, (uint32_t)off);
            }
            addr += got & I_SIZE;
        }
    }
}

static void reach(pint addr, rule_t st)
{
    if (!at(addr))
        return;                         /* does not decode (or lies outside): no row */
    size_t off = (size_t)(addr - R.start);
    rule_t old = R.state[off];
    if (!old) {
        R.state[off] = st;
        VPUSH(R.touched, (uint32_t)off);
        if (st == CONFLICT)
            R.conflict = 1;
    } else if (old != st && old != CONFLICT) {
        R.state[off] = CONFLICT;
        R.conflict = 1;
    } else {
        return;
    }
    VPUSH(R.work, (uint32_t)off);
}

static int has_rbp(int64_t rbp) { return rbp != 0 && rbp != RBP_LOST; }

/* _moved */
static rule_t moved(int kind, pint cfa, int64_t rbp, int *ok)
{
    if (has_rbp(rbp) && -8 * (pint)rbp > cfa)
        rbp = RBP_LOST;
    if (!(cfa >= 8 && cfa < 32768)) {
        *ok = 0;                        /* not a rule this table can say: _successors' test */
        return 0;
    }
    *ok = 1;
    return pack(kind, (int64_t)cfa, rbp);
}

/* _step, with _successors' test of its result: the rule after a
 * straight-line instruction, or CONFLICT */
static rule_t step(const struct desc *d, int kind, int64_t cfa, int64_t rbp, int in_prologue)
{
    uint32_t f = d->f;
    int ok;
    rule_t r;
#define RESULT(k, c, b) do { pint c_ = (c); if (!(c_ >= 8 && c_ < 32768)) return CONFLICT; \
                             return pack((k), (int64_t)c_, (b)); } while (0)
    if (kind == UR_RSP) {
        if (f & D_PUSH) {
            cfa += 8;
            if ((f & D_PUSH_RBP) && rbp == 0)
                rbp = floordiv(-cfa, 8);    /* the caller's rbp at CFA - cfa */
            RESULT(kind, cfa, rbp);
        }
        if (f & D_PUSHF)
            RESULT(kind, cfa + 8, rbp);
        if (f & D_POPF)
            RESULT(kind, cfa - 8, rbp);
        if (f & D_POP) {
            if (f & D_OPS_RBP) {
                if (rbp == 0 || rbp == RBP_LOST)
                    rbp = RBP_LOST;         /* a value of the body's, not the caller's */
                else if (rbp * 8 == -cfa)
                    rbp = 0;                /* the caller's, from where it was pushed */
            } else if (f & D_OPS_RSP) {
                return CONFLICT;
            }
            r = moved(kind, cfa - 8, rbp, &ok);
            return ok ? r : CONFLICT;
        }
        if (f & D_ADDSUB) {
            if (!(f & D_ADDSUB_IMM))
                return CONFLICT;
            r = moved(kind, (f & D_SUB) ? (pint)cfa + d->addsub : (pint)cfa - d->addsub, rbp, &ok);
            return ok ? r : CONFLICT;
        }
        if (f & D_LEA) {
            if (!(f & D_LEA_DISP))
                return CONFLICT;
            r = moved(kind, (pint)cfa - d->disp, rbp, &ok);
            return ok ? r : CONFLICT;
        }
        /* _frame_slot(load=True): a slot of this frame below the return address */
        if ((f & D_LOAD_RBP) && !((pint)d->load_x + 8 > (pint)cfa - 8) && has_rbp(rbp))
            RESULT(kind, cfa, (d->load_x - cfa == rbp * 8) ? 0 : rbp);
        if (f & D_MOV_RBP_RSP)
            RESULT(UR_RBP, cfa, rbp != 0 ? rbp : RBP_LOST);
        if (f & D_MOV_RBX_RSP)
            RESULT(UR_RBX, cfa, rbp);
        if ((f & D_IMPLICIT_RSP) || (f & D_W_RSP))
            return CONFLICT;
        if (in_prologue && (f & D_STORE_RBP) && !((pint)d->store_x + 8 > (pint)cfa - 8) && rbp == 0)
            RESULT(kind, cfa, floordiv(d->store_x - cfa, 8));
    } else if (kind == UR_RBP) {
        if (f & D_MOV_RSP_RBP)
            RESULT(UR_RSP, cfa, rbp);
        if (((f & D_POP) && (f & D_OPS_RBP)) || (f & D_ENTER) || (f & D_W_RBP))
            return CONFLICT;
        RESULT(kind, cfa, rbp);
    } else if (kind == UR_RBX) {
        if (f & D_MOV_RSP_RBX)
            RESULT(UR_RSP, cfa, rbp);
        if ((f & D_RBX_IMPLICIT) || ((f & D_POP) && (f & D_OPS_RBX)) || (f & D_W_RBX))
            return CONFLICT;
    }
    if (rbp == 0 && (((f & D_POP) && (f & D_OPS_RBP)) || (f & D_W_RBP)))
        rbp = RBP_LOST;                 /* the body takes rbp and the caller's was kept nowhere */
    RESULT(kind, cfa, rbp);
#undef RESULT
}

static int inside(pint a) { return R.start <= a && a < R.end; }

#define UNKNOWN (-1)

/* _traverse: the rules in R.state (R.touched), the exits' findings */
static int traverse(const pint *entries, size_t nent, int follow)
{
    rule_t entry = pack(UR_RSP, 8, 0);
    for (size_t k = 0; k < nent; k++)
        reach(entries[k], entry);
    while (R.work.n) {
        size_t off = R.work.v[--R.work.n];
        rule_t st = R.state[off];
        uint64_t info = R.info[off];
        pint a = R.start + (pint)off, nxt = a + (pint)(info & I_SIZE);
        if (info & I_RAISES)
            fail("prologue: an instruction without a mnemonic");
        if ((info & I_FAST) && !R.prol[off]) {
            reach(nxt, st);             /* most instructions: the rule goes on unchanged */
            continue;
        }
        const struct desc *d = desc_of(off);
        uint32_t f = d->f;
        int has_t = d->has_target;
        pint target = d->target;
        if (follow && (f & D_JLOOP) && !has_t)
            return UNKNOWN;             /* a jump through a register or memory */
        if ((f & D_CALL) && has_t && inside(target) && target != nxt)
            reach(target, entry);       /* a function of this code: entered as one */
        if ((f & D_RET) || ((f & D_JMP) && has_t && !inside(target))) {
            R.nexits++;
            if (st == CONFLICT || rkind(st) != UR_RSP || rcfa(st) != 8)
                R.bad_exit = 1;
        }
        /* _successors */
        pint succ[2];
        rule_t sst[2];
        int ns = 0;
        if ((f & D_LEAVE) && st != CONFLICT && rkind(st) == UR_RBP) {
            int64_t cfa = rcfa(st), rbp = rrbp(st);
            succ[0] = nxt;
            sst[0] = pack(UR_RSP, cfa - 8, rbp != RBP_LOST && rbp * 8 == -cfa ? 0 : RBP_LOST);
            ns = 1;
        } else if ((f & D_ENDS) && !(f & D_JMP)) {
            ns = 0;                     /* ret, ud2...: the frame ends here */
        } else if (f & D_JLOOP) {
            if (follow) {
                int in = has_t && inside(target);
                if (f & D_JMP) {
                    if (in) {
                        succ[ns] = target;
                        sst[ns++] = st;
                    }
                } else {
                    succ[ns] = nxt;
                    sst[ns++] = st;
                    if (in) {
                        succ[ns] = target;
                        sst[ns++] = st;
                    }
                }
            }
        } else if (st == CONFLICT) {
            succ[0] = nxt;
            sst[0] = CONFLICT;
            ns = 1;
        } else if (f & D_CALL) {
            int kind = rkind(st);
            succ[0] = nxt;
            sst[0] = (has_t && target == nxt && kind == UR_RSP) ? pack(kind, rcfa(st) + 8, rrbp(st)) : st;
            ns = 1;
        } else {
            succ[0] = nxt;
            sst[0] = step(d, rkind(st), rcfa(st), rrbp(st), R.prol[off]);
            ns = 1;
        }
        for (int k = 0; k < ns; k++) {
            if (!inside(succ[k]))
                continue;
            if (succ[k] != nxt && !at(succ[k]))
                return UNKNOWN;         /* a jump to bytes that do not decode */
            reach(succ[k], sst[k]);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* Rows                                                                */

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

static void add_row(struct entries *es, pint loc, rule_t key)
{
    uint32_t enc;
    if (key == CONFLICT) {
        enc = ENC(UR_INVALID | UR_DERIVED, 0, 0);
    } else {
        int64_t cfa = rcfa(key), rbp = rrbp(key);
        enc = (cfa >= -32768 && cfa < 32768 && rbp >= -128 && rbp < 128)
            ? ENC(rkind(key) | UR_DERIVED, cfa, rbp) : ENC_BAD;   /* ROW.pack raises on it */
    }
    entries_add(es, loc, key == CONFLICT, enc);
}

/* _rows(state, dec, start): CONFLICT stands for the invalid row */
static void rows_of(struct entries *es)
{
    uint32_t *addrs = R.touched.v;
    size_t n = R.touched.n;
    if (R.len / 16 <= n) {
        /* a function's instructions lie close together: in order by a scan */
        size_t k = 0;
        for (size_t off = 0; off < R.len && k < n; off++)
            if (R.state[off])
                addrs[k++] = (uint32_t)off;
    } else {
        if (n > 1)
            qsort(addrs, n, sizeof(*addrs), cmp_u32);
    }
    for (size_t i = 0; i + 1 < n; i++)
        if (addrs[i] + (R.info[addrs[i]] & I_SIZE) > addrs[i + 1]) {
            add_row(es, R.start, CONFLICT);     /* instructions that overlap */
            return;
        }
    int have = 0;
    rule_t last = 0;
    pint after = R.start;
    for (size_t i = 0; i < n; i++) {
        pint a = R.start + addrs[i];
        if (a != after && (!have || last != CONFLICT)) {
            add_row(es, after, CONFLICT);       /* bytes no path reaches */
            have = 1;
            last = CONFLICT;
        }
        rule_t enc = R.state[addrs[i]];
        if (!have || last != enc) {
            add_row(es, a, enc);
            have = 1;
            last = enc;
        }
        after = a + (pint)(R.info[addrs[i]] & I_SIZE);
    }
    if (!have || last != CONFLICT)
        add_row(es, after, CONFLICT);
}

/* function_rows */
static void function_rows(struct bytes code, pint start, const pint *entries, size_t nent, struct entries *es)
{
    region_begin(start, code);
    mark_prologue(entries, nent);
    if (traverse(entries, nent, 1) == UNKNOWN) {
        reset_states();
        traverse(entries, nent, 0);
    }
    rows_of(es);
    region_end();
}

/* _stays_inside */
static int stays_inside(void)
{
    for (size_t i = 0; i < R.touched.n; i++) {
        uint64_t info = R.info[R.touched.v[i]];
        pint e = R.start + R.touched.v[i] + (pint)(info & I_SIZE);
        if (e > R.end || (e == R.end && !(info & I_ENDRET)))
            return 0;
    }
    return 1;
}

/* gap_rows */
static void gap_rows(struct bytes code, pint start, const pint *cands, size_t ncand, struct entries *es)
{
    region_begin(start, code);
    VEC(pint) good = {0, 0, 0};
    for (size_t k = 0; k < ncand; k++) {
        if (k && cands[k] == cands[k - 1])
            continue;
        mark_prologue(&cands[k], 1);
        int r = traverse(&cands[k], 1, 1);
        if (r != UNKNOWN && R.nexits && !R.conflict && !R.bad_exit && stays_inside())
            VPUSH(good, cands[k]);
        reset_states();
        reset_marks();
    }
    if (good.n) {
        mark_prologue(good.v, good.n);
        if (traverse(good.v, good.n, 1) != UNKNOWN)
            rows_of(es);
    }
    VFREE(good);
    region_end();
}

/* ------------------------------------------------------------------ */
/* The regions                                                         */

struct text {
    pint lo, hi;
    const struct psec *sec;
};

struct reg {
    pint start, end;
    size_t first, n;            /* its entries: in ents (functions) or refs (gaps) */
    int gap;
    size_t order;
};

static int cmp_reg(const void *a, const void *b)
{
    const struct reg *x = a, *y = b;
    if (x->start != y->start)
        return x->start < y->start ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    if (x->gap != y->gap)
        return x->gap < y->gap ? -1 : 1;
    return x->order < y->order ? -1 : x->order > y->order;
}

static int cmp_sym(const void *a, const void *b)
{
    const struct sym *x = a, *y = b;
    if (x->value != y->value)
        return x->value < y->value ? -1 : 1;
    return x->size < y->size ? -1 : x->size > y->size;
}

/* uncovered_functions: (start, size), sorted by start, one per start */
static void uncovered_functions(const symvec *syms, const spanvec *covered, symvec *out)
{
    struct span *spans = xmalloc((covered->n + 1) * sizeof(*spans));
    if (covered->n)
        memcpy(spans, covered->v, covered->n * sizeof(*spans));
    sort_spans(spans, covered->n);
    pint *starts = xmalloc((covered->n + 1) * sizeof(*starts));
    for (size_t i = 0; i < covered->n; i++)
        starts[i] = spans[i].begin;
    symvec all = {0, 0, 0};
    for (size_t k = 0; k < syms->n; k++) {
        uint64_t start = syms->v[k].value, size = syms->v[k].size;
        if (size == 0 || size > MAX_FUNCTION_BYTES)
            continue;
        pint end = (pint)start + size;
        size_t i = bisect_right(starts, covered->n, end - 1);   /* the last FDE starting before our end */
        if (i > 0 && spans[i - 1].end > (pint)start)
            continue;
        VPUSH(all, syms->v[k]);
    }
    if (all.n > 1)
        qsort(all.v, all.n, sizeof(*all.v), cmp_sym);
    out->n = 0;
    for (size_t k = 0; k < all.n; k++)     /* two symbols at one start: the shorter */
        if (!out->n || out->v[out->n - 1].value != all.v[k].value)
            VPUSH(*out, all.v[k]);
    VFREE(all);
    free(spans);
    free(starts);
}

/* code_gaps */
static void code_gaps(const struct text *texts, size_t ntexts, const struct span *known, size_t nk,
                      spanvec *out)
{
    /* known is sorted: entries before the first whose running maximum of
     * ends passes lo all end before the section, the loop skips them */
    pint *maxend = xmalloc((nk + 1) * sizeof(*maxend));
    uint64_t steps = 0;
    for (size_t i = 0; i < nk; i++)
        maxend[i] = i && maxend[i - 1] > known[i].end ? maxend[i - 1] : known[i].end;
    for (size_t t = 0; t < ntexts; t++) {
        pint lo = texts[t].lo, hi = texts[t].hi, cur = lo;
        size_t i = bisect_right(maxend, nk, lo);
        for (; i < nk; i++) {
            if (++steps > MAX_GAP_STEPS)
                fail("executable sections that overlap, over and over");
            pint a = known[i].begin, b = known[i].end;
            if (a >= hi)
                break;                  /* sorted: none after it either */
            if (b <= cur)
                continue;
            if (a - cur >= MIN_GAP_BYTES) {
                struct span g = {cur, a};
                VPUSH(*out, g);
            }
            if (b > cur)
                cur = b;
        }
        if (hi - cur >= MIN_GAP_BYTES) {
            struct span g = {cur, hi};
            VPUSH(*out, g);
        }
    }
    free(maxend);
}

static uint64_t rd64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }

typedef VEC(pint) pintvec;

/* function_pointers: the addends of R_X86_64_RELATIVE relocations */
static void function_pointers(struct pyelf *pe, pintvec *out)
{
    for (size_t i = 0; i < pe->nsec; i++) {
        const struct psec *s = &pe->sec[i];
        if (s->type != PY_SHT_RELA || s->entsize != 24)
            continue;
        struct bytes d = pyelf_data(pe, s);
        if (d.n % 24)
            fail("struct.error: relocations of %zu bytes", d.n);
        for (size_t c0 = 0; c0 < d.n; c0 += SCAN_CHUNK) {
            size_t ce = d.n - c0 > SCAN_CHUNK ? c0 + SCAN_CHUNK : d.n;
            for (size_t off = c0; off < ce; off += 24)
                if ((rd64(d.p + off + 8) & 0xFFFFFFFF) == 8)
                    VPUSH(*out, (pint)(int64_t)rd64(d.p + off + 16));
            elf_release(&pe->f, d.p + c0, ce - c0);
        }
    }
}

/* code_references: targets of call rel32 and lea REG, [rip + disp32]
 * inside the gaps, found by their bytes */
static void code_references(struct pyelf *pe, const struct text *texts, size_t ntexts,
                            const struct span *gaps, size_t ngaps, pintvec *out)
{
    pint lo_g = gaps[0].begin, hi_g = gaps[ngaps - 1].end;
    pint *starts = xmalloc(ngaps * sizeof(*starts));
    for (size_t i = 0; i < ngaps; i++)
        starts[i] = gaps[i].begin;
    static unsigned char modrm[256];
    for (int r = 0; r < 8; r++)
        modrm[0x05 + 8 * r] = 1;
#define TAKE(t) do { pint t_ = (t); if (lo_g <= t_ && t_ < hi_g) { \
            size_t i_ = bisect_right(starts, ngaps, t_); \
            if (i_ > 0 && t_ < gaps[i_ - 1].end) VPUSH(*out, t_); } } while (0)
    for (size_t t = 0; t < ntexts; t++) {
        struct bytes d = pyelf_data(pe, texts[t].sec);
        pint base = texts[t].sec->addr;
        const unsigned char *p = d.p, *e = d.p + d.n;
        /* in chunks, each given back once read: the code of a large library
         * is not all resident at once */
        for (size_t c0 = 0; c0 < d.n; c0 += SCAN_CHUNK) {
            const unsigned char *ce = p + (d.n - c0 > SCAN_CHUNK ? c0 + SCAN_CHUNK : d.n);
            /* \xe8, then 4 bytes: rel32 */
            for (const unsigned char *q = p + c0; q < ce && (q = memchr(q, 0xE8, (size_t)(ce - q))); q++) {
                size_t off = (size_t)(q - p);
                if (off + 5 > d.n)
                    break;
                int32_t rel;
                memcpy(&rel, q + 1, 4);
                TAKE(base + (pint)off + 5 + rel);
            }
            /* [\x48\x4c] \x8d [modrm rip-relative], then disp32 */
            for (const unsigned char *q = p + (c0 ? c0 : 1); q < ce && (q = memchr(q, 0x8D, (size_t)(ce - q))); q++) {
                if (q + 1 >= e || !modrm[q[1]] || (q[-1] != 0x48 && q[-1] != 0x4C))
                    continue;
                size_t off = (size_t)(q - 1 - p);
                if (off + 7 > d.n)
                    break;
                int32_t rel;
                memcpy(&rel, q + 2, 4);
                TAKE(base + (pint)off + 7 + rel);
            }
            elf_release(&pe->f, p + c0, (size_t)(ce - (p + c0)));
        }
    }
#undef TAKE
    free(starts);
}

static void unique_pints(pintvec *v)
{
    sort_pints(v->v, v->n);
    size_t k = 0;
    for (size_t i = 0; i < v->n; i++)
        if (!k || v->v[k - 1] != v->v[i])
            v->v[k++] = v->v[i];
    v->n = k;
}

void derived_rows(struct pyelf *pe, const spanvec *fde_spans, const symvec *syms, struct entries *es)
{
    capstone_load();
    symvec funcs = {0, 0, 0};
    uncovered_functions(syms, fde_spans, &funcs);
    VEC(struct text) texts = {0, 0, 0};
    for (size_t i = 0; i < pe->nsec; i++) {
        const struct psec *s = &pe->sec[i];
        if ((s->flags & PY_SHF_EXECINSTR) && s->type == PY_SHT_PROGBITS) {
            struct text t = {s->addr, (pint)s->addr + s->size, s};
            VPUSH(texts, t);
        }
    }
    /* _regions(funcs): those that overlap are one region, entered at each start */
    VEC(struct reg) regions = {0, 0, 0};
    pintvec ents = {0, 0, 0};
    for (size_t k = 0; k < funcs.n; k++) {
        pint start = funcs.v[k].value, end = start + (pint)funcs.v[k].size;
        if (regions.n && start < regions.v[regions.n - 1].end) {
            struct reg *r = &regions.v[regions.n - 1];
            if (end > r->end)
                r->end = end;
            r->n++;
        } else {
            struct reg r = {start, end, ents.n, 1, 0, regions.n};
            VPUSH(regions, r);
        }
        VPUSH(ents, start);
    }
    VFREE(funcs);
    /* the gaps no FDE and no function symbol cover */
    spanvec known = {0, 0, 0};
    VRESERVE(known, fde_spans->n + syms->n + 1);
    if (fde_spans->n)
        memcpy(known.v, fde_spans->v, fde_spans->n * sizeof(*known.v));
    known.n = fde_spans->n;
    for (size_t k = 0; k < syms->n; k++)
        if (syms->v[k].size > 0) {
            struct span s = {syms->v[k].value, (pint)syms->v[k].value + syms->v[k].size};
            known.v[known.n++] = s;
        }
    sort_spans(known.v, known.n);
    spanvec all_gaps = {0, 0, 0}, gaps = {0, 0, 0};
    code_gaps(texts.v, texts.n, known.v, known.n, &all_gaps);
    VFREE(known);
    for (size_t i = 0; i < all_gaps.n; i++)
        if (all_gaps.v[i].end - all_gaps.v[i].begin <= MAX_GAP_BYTES)
            VPUSH(gaps, all_gaps.v[i]);
    VFREE(all_gaps);
    pintvec refs = {0, 0, 0};
    if (gaps.n) {
        function_pointers(pe, &refs);
        code_references(pe, texts.v, texts.n, gaps.v, gaps.n, &refs);
        unique_pints(&refs);
        for (size_t g = 0; g < gaps.n; g++) {
            size_t i = bisect_left(refs.v, refs.n, gaps.v[g].begin);
            size_t j = bisect_left(refs.v, refs.n, gaps.v[g].end);
            if (j > i) {
                struct reg r = {gaps.v[g].begin, gaps.v[g].end, i, j - i, 1, regions.n};
                VPUSH(regions, r);
            }
        }
    }
    VFREE(gaps);
    if (regions.n > 1)
        qsort(regions.v, regions.n, sizeof(*regions.v), cmp_reg);
    /* data_of: a section's bytes, by its address */
    VEC(struct { pint lo; struct bytes d; }) data_of = {0, 0, 0};
    for (size_t k = 0; k < regions.n; k++) {
        const struct reg *r = &regions.v[k];
        const struct text *t = 0;
        for (size_t i = 0; i < texts.n && !t; i++)
            if (texts.v[i].lo <= r->start && r->end <= texts.v[i].hi)
                t = &texts.v[i];
        if (!t)
            continue;
        struct bytes data = {0, 0};
        int found = 0;
        for (size_t i = 0; i < data_of.n && !found; i++)
            if (data_of.v[i].lo == t->lo) {
                data = data_of.v[i].d;
                found = 1;
            }
        if (!found) {
            data = pyelf_data(pe, t->sec);
            VRESERVE(data_of, data_of.n + 1);
            data_of.v[data_of.n].lo = t->lo;
            data_of.v[data_of.n].d = data;
            data_of.n++;
        }
        /* data_of[lo][start - lo:end - lo] */
        pint a = r->start - t->lo, b = r->end - t->lo;
        if (a > (pint)data.n)
            a = data.n;
        if (b > (pint)data.n)
            b = data.n;
        if (b < a)
            b = a;
        struct bytes code = {data.p + (size_t)a, (size_t)(b - a)};
        if (r->gap)
            gap_rows(code, r->start, refs.v + r->first, r->n, es);
        else
            function_rows(code, r->start, ents.v + r->first, r->n, es);
    }
    VFREE(data_of);
    VFREE(refs);
    VFREE(ents);
    VFREE(regions);
    VFREE(texts);
}
