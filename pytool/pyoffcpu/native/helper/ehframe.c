/* .eh_frame: tests/reference/ehframe.py's parse_eh_frame and the FDE part
 * of unwind_table.py's build_table (encode_row, the unsupported count), streamed:
 * each FDE's rows go to the table entries as they are made (_dedupe
 * keeps the last row of one loc), never kept.
 *
 * Positions and values are Python ints (pint); where the Python indexes
 * `data[pos]`, slices or unpacks, it does so with Python's rules
 * (negative positions count from the end: an FDE's CIE pointer can point
 * before the section), and where it raises (IndexError, ValueError,
 * struct.error, EhFrameError) this fails. */
#include "tables.h"

#include <stdlib.h>
#include <string.h>


#define REG_RBP 6
#define REG_RSP 7
#define REG_RA 16
#define R_SAME 0
#define R_OFFSET 1
#define R_UNDEFINED 2
#define R_OTHER 3
#define R_AT_RBP 4

/* data[pos]: -1 where it raises IndexError */
static int byte_at(struct bytes d, pint pos, unsigned *b)
{
    if (pos < 0)
        pos += (pint)d.n;
    if (pos < 0 || pos >= (pint)d.n)
        return -1;
    *b = d.p[(size_t)pos];
    return 0;
}

/* data[a:b] */
static struct bytes slice(struct bytes d, pint a, pint b)
{
    pint n = d.n;
    if (a < 0) {
        a += n;
        if (a < 0)
            a = 0;
    } else if (a > n) {
        a = n;
    }
    if (b < 0) {
        b += n;
        if (b < 0)
            b = 0;
    } else if (b > n) {
        b = n;
    }
    if (b < a)
        b = a;
    struct bytes r = {d.p + (size_t)a, (size_t)(b - a)};
    return r;
}

/* struct.unpack_from's offset: -1 where it raises */
static int unpack_at(struct bytes d, pint pos, size_t size, size_t *at)
{
    if (pos < 0) {
        if (pos + (pint)d.n < 0)
            return -1;
        pos += (pint)d.n;
    }
    if (pos + (pint)size > (pint)d.n)
        return -1;
    *at = (size_t)pos;
    return 0;
}

static uint64_t le(const unsigned char *p, size_t n)
{
    uint64_t v = 0;
    for (size_t i = n; i-- > 0;)
        v = v << 8 | p[i];
    return v;
}

/* A LEB128 number: its value (saturated) and its low 64 bits (exact, for
 * `val & 0xFFFFFFFFFFFFFFFF`). */
struct leb {
    pint v;
    uint64_t lo;
};

/* read_uleb (signed=0: `pos >= len(data)` raises ValueError first) and
 * read_sleb (signed=1): 0 with the value and the position after it */
static int read_leb(struct bytes d, pint pos, int is_signed, struct leb *out, pint *npos)
{
    unsigned __int128 acc = 0;          /* bits 0..125 */
    uint64_t lo = 0;
    int hi_zeros = 1, hi_ones = 1;
    unsigned shift = 0, b;
    for (;;) {
        if (!is_signed && pos >= (pint)d.n)
            return -1;
        if (byte_at(d, pos, &b) != 0)
            return -1;
        pos += 1;
        unsigned bits = b & 0x7F;
        if (shift < 64)
            lo |= (uint64_t)bits << shift;
        if (shift <= 119)
            acc |= (unsigned __int128)bits << shift;
        else {
            hi_zeros &= bits == 0;
            hi_ones &= bits == 0x7F;
        }
        if (shift < 1000000)
            shift += 7;
        if (b < 0x80)
            break;
    }
    pint v;
    if (!is_signed || !(b & 0x40)) {
        v = hi_zeros ? psat((pint)acc) : PBIG;
    } else if (shift <= 126) {
        v = psat((pint)acc - ((pint)1 << shift));
        if (shift < 64)
            lo -= (uint64_t)1 << shift;
    } else {
        v = hi_ones ? psat((pint)acc - ((pint)1 << 126)) : -PBIG;
    }
    out->v = v;
    out->lo = lo;
    *npos = pos;
    return 0;
}

int read_sleb_bytes(struct bytes b, pint pos, pint *val, pint *npos)
{
    struct leb l;
    if (read_leb(b, pos, 1, &l, npos) != 0)
        return -1;
    *val = l.v;
    return 0;
}

static pint uleb(struct bytes d, pint *pos)
{
    struct leb l;
    if (read_leb(d, *pos, 0, &l, pos) != 0)
        fail(".eh_frame: truncated LEB128");
    return l.v;
}

static pint sleb(struct bytes d, pint *pos)
{
    struct leb l;
    if (read_leb(d, *pos, 1, &l, pos) != 0)
        fail(".eh_frame: truncated LEB128");
    return l.v;
}

static unsigned byte(struct bytes d, pint pos)
{
    unsigned b;
    if (byte_at(d, pos, &b) != 0)
        fail(".eh_frame: index out of range");
    return b;
}

/* read_encoded: the value (value_only: as read, else applied and masked to
 * 64 bits), and the position after it */
static pint read_encoded(struct bytes d, pint *pos, unsigned enc, pint field_addr, int value_only)
{
    unsigned fmt = enc & 0x0F;
    struct leb l;
    if (fmt == 0x01 || fmt == 0x09) {
        if (read_leb(d, *pos, fmt == 0x09, &l, pos) != 0)
            fail(".eh_frame: truncated LEB128");
    } else {
        size_t size;
        int is_signed = fmt >= 0x0A;
        switch (fmt) {
        case 0x00: case 0x04: case 0x0C: size = 8; break;
        case 0x02: case 0x0A: size = 2; break;
        case 0x03: case 0x0B: size = 4; break;
        default: fail(".eh_frame: unsupported pointer encoding %#x", enc);
        }
        size_t at;
        if (unpack_at(d, *pos, size, &at) != 0)
            fail(".eh_frame: pointer past the end");
        uint64_t u = le(d.p + at, size);
        l.lo = u;
        l.v = u;
        if (is_signed) {
            int64_t s = size == 2 ? (int16_t)u : size == 4 ? (int32_t)u : (int64_t)u;
            l.v = s;
            l.lo = (uint64_t)s;
        }
        *pos += size;
    }
    if (value_only)
        return l.v;
    unsigned app = enc & 0x70;
    uint64_t v = l.lo;
    if (app == 0x10)                                /* pcrel */
        v += (uint64_t)field_addr;
    else if (app != 0 && app != 0x30 && app != 0x50)    /* datarel adds data_base 0 */
        fail(".eh_frame: unsupported pointer application %#x", enc);
    return v;
}

/* ------------------------------------------------------------------ */

struct rule {
    int kind;
    int64_t off;                /* saturated at +-2^62: only compared with small numbers */
};

struct cstate {
    int64_t cfa_reg, cfa_off;
    struct bytes expr;
    int has_expr;
    struct rule rbp, ra;
};

static int64_t clamp64(pint v)
{
    const pint m = (pint)1 << 62;
    return (int64_t)(v > m ? m : v < -m ? -m : v);
}

static int state_eq(const struct cstate *a, const struct cstate *b)
{
    return a->cfa_reg == b->cfa_reg && a->cfa_off == b->cfa_off && a->has_expr == b->has_expr
        && (!a->has_expr || (a->expr.p == b->expr.p && a->expr.n == b->expr.n))
        && a->rbp.kind == b->rbp.kind && a->rbp.off == b->rbp.off
        && a->ra.kind == b->ra.kind && a->ra.off == b->ra.off;
}

struct cie {
    pint code_align, data_align;
    unsigned fde_enc;
    int has_aug_data, signal_frame;
    struct bytes initial;
};

/* One FDE's rows on their way to the entries (the _dedupe of its rows and
 * the loop of build_table over them). */
struct fde_ctx {
    pint pc_begin, pc_end;
    int signal;
    int pending;
    pint pend_loc;
    struct cstate pend;
    struct entries *es;
    uint64_t *unsupported;
};

static int plt_threshold(struct bytes e, pint *off, int *k)
{
    if (e.n < 11 || e.p[0] != 0x77)
        return 0;
    pint pos;
    if (read_sleb_bytes(e, 1, off, &pos) != 0)
        fail(".eh_frame: truncated expression");
    struct bytes t = slice(e, pos, e.n);
    if (t.n == 9 && t.p[0] == 0x80 && t.p[1] == 0x00 && t.p[2] == 0x3F && t.p[3] == 0x1A
            && t.p[4] >= 0x30 && t.p[4] <= 0x4F && memcmp(t.p + 5, "\x2a\x33\x24\x22", 4) == 0) {
        *k = t.p[4] - 0x30;
        return 1;
    }
    return 0;
}

static int drap_offset(struct bytes e, pint *off)
{
    if (e.n < 3 || e.p[0] != 0x76)
        return 0;
    pint pos;
    if (read_sleb_bytes(e, 1, off, &pos) != 0)
        fail(".eh_frame: truncated expression");
    struct bytes t = slice(e, pos, e.n);
    return t.n == 1 && t.p[0] == 0x06;
}

/* table.encode_row */
static uint32_t encode_row(const struct cstate *r)
{
    int kind;
    int64_t cfa_off;
    int ra_ok = r->ra.kind == R_OFFSET && r->ra.off == -8;
    if (r->ra.kind == R_UNDEFINED)
        return ENC(UR_END, 0, 0);
    if (r->has_expr) {
        pint off;
        int k;
        if (plt_threshold(r->expr, &off, &k) && off >= -32768 && off < 32768 && ra_ok)
            return ENC(UR_PLT, (int)off, k);
        pint drap;
        if (!drap_offset(r->expr, &drap) || !(drap >= -32768 && drap < 32768) || !ra_ok)
            return ENC(UR_INVALID, 0, 0);
        kind = UR_DRAP;
        cfa_off = (int64_t)drap;
    } else if (!ra_ok) {
        return ENC(UR_INVALID, 0, 0);
    } else if (r->cfa_reg == REG_RSP) {
        kind = UR_RSP;
        cfa_off = r->cfa_off;
    } else if (r->cfa_reg == REG_RBP) {
        kind = UR_RBP;
        cfa_off = r->cfa_off;
    } else {
        return ENC(UR_INVALID, 0, 0);
    }
    if (!(cfa_off >= -32768 && cfa_off < 32768))
        return ENC(UR_INVALID, 0, 0);
    int rbp;
    int64_t ro = r->rbp.off;
    if (r->rbp.kind == R_SAME)
        rbp = 0;
    else if (r->rbp.kind == R_OFFSET && ro % 8 == 0 && ro >= -127 * 8 && ro < 0)
        rbp = (int)(ro / 8);
    else if (r->rbp.kind == R_AT_RBP && ro == 0 && kind == UR_DRAP)
        rbp = RBP_AT_RBP;
    else
        rbp = RBP_LOST;
    return ENC(kind, (int)cfa_off, rbp);
}

static void flush(struct fde_ctx *c)
{
    if (!(c->pc_begin <= c->pend_loc && c->pend_loc < c->pc_end))
        return;
    uint32_t enc = c->signal ? ENC(UR_INVALID, 0, 0) : encode_row(&c->pend);
    if (ENC_KIND(enc) == UR_INVALID)
        (*c->unsupported)++;
    entries_add(c->es, c->pend_loc, 0, enc);
}

/* rows.append(state.row(loc)), through _dedupe */
static void emit(struct fde_ctx *c, pint loc, const struct cstate *st)
{
    if (c->pending && c->pend_loc == loc) {
        c->pend = *st;
        return;
    }
    if (c->pending)
        flush(c);
    c->pending = 1;
    c->pend_loc = loc;
    c->pend = *st;
}

static void set_reg(struct cstate *s, pint reg, struct rule r)
{
    if (reg == REG_RBP)
        s->rbp = r;
    else if (reg == REG_RA)
        s->ra = r;
}

static struct rule initial_rule(const struct cstate *initial, pint reg)
{
    struct rule same = {R_SAME, 0};
    if (!initial)
        return same;
    if (reg == REG_RBP)
        return initial->rbp;
    if (reg == REG_RA)
        return initial->ra;
    return same;
}

static struct rule offset_rule(pint off)
{
    struct rule r = {R_OFFSET, clamp64(off)};
    return r;
}

/* _expression_rule */
static struct rule expression_rule(struct bytes e)
{
    struct rule other = {R_OTHER, 0};
    if (e.n && e.p[0] == 0x76) {
        pint off, end;
        if (read_sleb_bytes(e, 1, &off, &end) != 0)
            fail(".eh_frame: truncated expression");
        if (end == (pint)e.n) {
            struct rule r = {R_AT_RBP, clamp64(off)};
            return r;
        }
    }
    return other;
}

/* remember_state's stack: equal states pushed one after another share an
 * entry (a file of remember_state bytes costs no memory) */
struct saved {
    struct cstate s;
    uint64_t count;
};
#define MAX_SAVED (1u << 22)

/* _run_program; rows: 0 for a CIE's initial instructions */
static void run_program(struct bytes prog, const struct cie *cie, struct cstate *state,
                        const struct cstate *initial, pint *loc, struct fde_ctx *rows, pint field_base)
{
    pint pos = 0, n = prog.n;
    VEC(struct saved) stack = {0, 0, 0};
    pint caf = cie->code_align, daf = cie->data_align;
    struct rule r;
    while (pos < n) {
        unsigned op = prog.p[(size_t)pos];
        pos += 1;
        unsigned hi = op & 0xC0, low = op & 0x3F;
        if (hi == 0x40) {                                       /* advance_loc */
            if (rows)
                emit(rows, *loc, state);
            *loc = padd(*loc, pmul(low, caf));
            continue;
        }
        if (hi == 0x80) {                                       /* offset */
            pint off = uleb(prog, &pos);
            set_reg(state, low, offset_rule(pmul(off, daf)));
            continue;
        }
        if (hi == 0xC0) {                                       /* restore */
            set_reg(state, low, initial_rule(initial, low));
            continue;
        }
        pint reg, off, ln;
        switch (op) {
        case 0x00:
            break;
        case 0x02: case 0x03: case 0x04: {                      /* advance_loc1/2/4 */
            size_t size = op == 0x02 ? 1 : op == 0x03 ? 2 : 4;
            struct bytes b = slice(prog, pos, pos + size);
            pint delta = le(b.p, b.n);
            pos += size;
            if (rows)
                emit(rows, *loc, state);
            *loc = padd(*loc, pmul(delta, caf));
            break;
        }
        case 0x01: {                                            /* set_loc */
            pint new_loc = read_encoded(prog, &pos, cie->fde_enc, field_base + pos, 0);
            if (rows)
                emit(rows, *loc, state);
            *loc = new_loc;
            break;
        }
        case 0x05:                                              /* offset_extended */
            reg = uleb(prog, &pos);
            off = uleb(prog, &pos);
            set_reg(state, reg, offset_rule(pmul(off, daf)));
            break;
        case 0x06:                                              /* restore_extended */
            reg = uleb(prog, &pos);
            set_reg(state, reg, initial_rule(initial, reg));
            break;
        case 0x07:                                              /* undefined */
            reg = uleb(prog, &pos);
            r.kind = R_UNDEFINED;
            r.off = 0;
            set_reg(state, reg, r);
            break;
        case 0x08:                                              /* same_value */
            reg = uleb(prog, &pos);
            r.kind = R_SAME;
            r.off = 0;
            set_reg(state, reg, r);
            break;
        case 0x09:                                              /* register */
            reg = uleb(prog, &pos);
            (void)uleb(prog, &pos);
            r.kind = R_OTHER;
            r.off = 0;
            set_reg(state, reg, r);
            break;
        case 0x0A:                                              /* remember_state */
            if (stack.n && state_eq(&stack.v[stack.n - 1].s, state)) {
                stack.v[stack.n - 1].count++;
            } else {
                if (stack.n >= MAX_SAVED)
                    fail(".eh_frame: remember_state nested too deep");
                struct saved sv = {*state, 1};
                VPUSH(stack, sv);
            }
            break;
        case 0x0B:                                              /* restore_state */
            if (stack.n) {
                *state = stack.v[stack.n - 1].s;
                if (--stack.v[stack.n - 1].count == 0)
                    stack.n--;
            }
            break;
        case 0x0C:                                              /* def_cfa */
            state->cfa_reg = clamp64(uleb(prog, &pos));
            state->cfa_off = clamp64(uleb(prog, &pos));
            state->has_expr = 0;
            break;
        case 0x0D:                                              /* def_cfa_register */
            state->cfa_reg = clamp64(uleb(prog, &pos));
            state->has_expr = 0;
            break;
        case 0x0E:                                              /* def_cfa_offset */
            state->cfa_off = clamp64(uleb(prog, &pos));
            break;
        case 0x0F:                                              /* def_cfa_expression */
            ln = uleb(prog, &pos);
            state->expr = slice(prog, pos, padd(pos, ln));
            state->has_expr = 1;
            pos = padd(pos, ln);
            break;
        case 0x10: case 0x16: {                                 /* expression, val_expression */
            reg = uleb(prog, &pos);
            ln = uleb(prog, &pos);
            struct bytes e = slice(prog, pos, padd(pos, ln));
            pos = padd(pos, ln);
            if (op == 0x10) {
                r = expression_rule(e);
            } else {
                r.kind = R_OTHER;
                r.off = 0;
            }
            set_reg(state, reg, r);
            break;
        }
        case 0x11:                                              /* offset_extended_sf */
            reg = uleb(prog, &pos);
            off = sleb(prog, &pos);
            set_reg(state, reg, offset_rule(pmul(off, daf)));
            break;
        case 0x12:                                              /* def_cfa_sf */
            state->cfa_reg = clamp64(uleb(prog, &pos));
            off = sleb(prog, &pos);
            state->cfa_off = clamp64(pmul(off, daf));
            state->has_expr = 0;
            break;
        case 0x13:                                              /* def_cfa_offset_sf */
            off = sleb(prog, &pos);
            state->cfa_off = clamp64(pmul(off, daf));
            break;
        case 0x14: case 0x15:                                   /* val_offset(_sf) */
            reg = uleb(prog, &pos);
            if (op == 0x14)
                (void)uleb(prog, &pos);
            else
                (void)sleb(prog, &pos);
            r.kind = R_OTHER;
            r.off = 0;
            set_reg(state, reg, r);
            break;
        case 0x2E:                                              /* GNU_args_size */
            (void)uleb(prog, &pos);
            break;
        case 0x2F:                                              /* GNU_negative_offset_extended */
            reg = uleb(prog, &pos);
            off = uleb(prog, &pos);
            set_reg(state, reg, offset_rule(pmul(-off, daf)));
            break;
        default:
            fail(".eh_frame: unknown CFA instruction %#x", op);
        }
    }
    VFREE(stack);
}

/* _parse_cie(data, pos, end) */
static void parse_cie(struct bytes d, pint pos, pint end, struct cie *c)
{
    memset(c, 0, sizeof(*c));
    c->fde_enc = 0x00;
    unsigned version = byte(d, pos);
    pos += 1;
    /* data.index(b"\0", pos) */
    pint from = pos;
    if (from < 0) {
        from += (pint)d.n;
        if (from < 0)
            from = 0;
    }
    if (from > (pint)d.n)
        fail(".eh_frame: CIE augmentation without its end");
    const unsigned char *z = memchr(d.p + (size_t)from, 0, d.n - (size_t)from);
    if (!z)
        fail(".eh_frame: CIE augmentation without its end");
    pint aug_end = z - d.p;
    struct bytes aug = slice(d, pos, aug_end);
    pos = aug_end + 1;
    int has_eh = 0;
    for (size_t i = 0; i + 1 < aug.n; i++)
        if (aug.p[i] == 'e' && aug.p[i + 1] == 'h')
            has_eh = 1;
    if (has_eh)
        pos += 8;
    if (version >= 4) {
        (void)byte(d, pos);                 /* address_size */
        pos += 2;
    }
    c->code_align = uleb(d, &pos);
    c->data_align = sleb(d, &pos);
    if (version == 1) {
        (void)byte(d, pos);
        pos += 1;
    } else {
        (void)uleb(d, &pos);
    }
    if (aug.n && aug.p[0] == 'z') {
        c->has_aug_data = 1;
        pint ln = uleb(d, &pos);
        pint aug_data_end = padd(pos, ln);
        pint p = pos;
        for (size_t i = 1; i < aug.n; i++) {
            unsigned ch = aug.p[i];
            if (ch == 'R') {
                c->fde_enc = byte(d, p);
                p += 1;
            } else if (ch == 'L') {
                (void)byte(d, p);
                p += 1;
            } else if (ch == 'P') {
                unsigned penc = byte(d, p);
                p += 1;
                (void)read_encoded(d, &p, penc & 0x7F, 0, 1);
            } else if (ch == 'S') {
                c->signal_frame = 1;
            } else if (ch == 'B' || ch == 'G') {
            } else {
                break;                      /* unknown: the rest is opaque */
            }
        }
        pos = aug_data_end;
    } else if (!(aug.n == 0 || (aug.n == 2 && aug.p[0] == 'e' && aug.p[1] == 'h'))) {
        fail(".eh_frame: CIE augmentation without 'z'");
    }
    c->initial = slice(d, pos, end);
}

/* dict keyed by position: the CIEs and their initial states */
struct cie_slot {
    int64_t key;
    int used, has_state;
    struct cie cie;
    struct cstate state;
};
static struct {
    struct cie_slot *v;
    size_t cap, n;
} cies;

static uint64_t hash64(int64_t k)
{
    uint64_t x = (uint64_t)k * 0x9E3779B97F4A7C15ull;
    return x ^ (x >> 29);
}

static struct cie_slot *cie_slot(int64_t key, int create)
{
    if (create && (cies.n + 1) * 2 > cies.cap) {
        size_t ncap = cies.cap ? cies.cap * 2 : 64;
        struct cie_slot *nv = xcalloc(ncap, sizeof(*nv));
        for (size_t i = 0; i < cies.cap; i++) {
            if (!cies.v[i].used)
                continue;
            size_t j = hash64(cies.v[i].key) & (ncap - 1);
            while (nv[j].used)
                j = (j + 1) & (ncap - 1);
            nv[j] = cies.v[i];
        }
        free(cies.v);
        cies.v = nv;
        cies.cap = ncap;
    }
    if (!cies.cap)
        return 0;
    size_t j = hash64(key) & (cies.cap - 1);
    while (cies.v[j].used) {
        if (cies.v[j].key == key)
            return &cies.v[j];
        j = (j + 1) & (cies.cap - 1);
    }
    if (!create)
        return 0;
    memset(&cies.v[j], 0, sizeof(cies.v[j]));
    cies.v[j].used = 1;
    cies.v[j].key = key;
    cies.n++;
    return &cies.v[j];
}

uint64_t ehframe_entries(struct bytes data, uint64_t section_addr, struct entries *es, spanvec *spans)
{
    uint64_t unsupported = 0;
    pint pos = 0, n = data.n;
    while (pos + 4 <= n) {
        pint start = pos;
        pint length = le(data.p + (size_t)pos, 4);
        pos += 4;
        if (length == 0)
            break;                          /* a zero terminator */
        if (length == 0xFFFFFFFF) {
            if (pos + 8 > n)
                fail(".eh_frame: truncated entry length");
            length = le(data.p + (size_t)pos, 8);
            pos += 8;
        }
        pint body = pos, end = body + length;
        if (end > n)
            fail(".eh_frame: entry at %#llx runs past the section", (unsigned long long)start);
        if (body + 4 > n)
            fail(".eh_frame: truncated entry");
        uint32_t cie_id = (uint32_t)le(data.p + (size_t)body, 4);
        pint p = body + 4;
        if (cie_id == 0) {
            struct cie c;
            parse_cie(data, p, end, &c);
            struct cie_slot *s = cie_slot((int64_t)start, 1);
            s->cie = c;                     /* a state made from an older parse stays */
            pos = end;
            continue;
        }
        int64_t cie_pos = (int64_t)body - cie_id;
        struct cie_slot *slot = cie_slot(cie_pos, 0);
        if (!slot) {
            size_t at;
            if (unpack_at(data, cie_pos, 4, &at) != 0)
                fail(".eh_frame: CIE pointer out of the section");
            pint ln = le(data.p + at, 4);
            struct cie c;
            parse_cie(data, (pint)cie_pos + 8, (pint)cie_pos + 4 + ln, &c);
            slot = cie_slot(cie_pos, 1);
            slot->cie = c;
        }
        struct cie cie = slot->cie;
        pint pc_begin = read_encoded(data, &p, cie.fde_enc, (pint)section_addr + p, 0);
        pint pc_range = read_encoded(data, &p, cie.fde_enc, 0, 1);
        if (cie.has_aug_data) {
            pint ln = uleb(data, &p);
            p = padd(p, ln);
        }
        struct bytes prog = slice(data, p, end);
        pos = end;
        if (pc_range == 0)
            continue;
        if (!slot->has_state) {
            struct cstate init = {REG_RSP, 8, {0, 0}, 0, {R_SAME, 0}, {R_SAME, 0}};
            pint loc = pc_begin;
            run_program(cie.initial, &cie, &init, 0, &loc, 0, 0);
            slot = cie_slot(cie_pos, 0);    /* (no slot is added meanwhile) */
            slot->state = init;
            slot->has_state = 1;
        }
        struct cstate initial = slot->state, state = initial;
        struct fde_ctx ctx;
        memset(&ctx, 0, sizeof(ctx));
        ctx.pc_begin = pc_begin;
        ctx.pc_end = padd(pc_begin, pc_range);
        ctx.signal = cie.signal_frame;
        ctx.es = es;
        ctx.unsupported = &unsupported;
        pint loc = pc_begin;
        run_program(prog, &cie, &state, &initial, &loc, &ctx, (pint)section_addr + p);
        emit(&ctx, loc, &state);
        flush(&ctx);
        entries_add(es, ctx.pc_end, 1, ENC(UR_INVALID, 0, 0));
        struct span sp = {pc_begin, ctx.pc_end};
        VPUSH(*spans, sp);
    }
    free(cies.v);
    memset(&cies, 0, sizeof(cies));
    return unsupported;
}
