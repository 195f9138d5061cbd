/* Canonical bytes of a serialized HloModuleProto: the C implementation of
 * worker/keylib/hlocanon.py (which documents the canonical form and is the
 * reference; tests/test_hlocanon.py checks both give the same bytes).
 *
 * One pass records every computation's and instruction's position, a second
 * writes the canonical stream. No protobuf library: fields are walked at the
 * wire level and copied unless the schema below says otherwise. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { VARINT = 0, I64 = 1, LEN = 2, SGROUP = 3, EGROUP = 4, I32 = 5 };
#define UNRESOLVED ((uint64_t)1 << 28)
#define MAX_DEPTH 64
/* The per-field helpers, inlined into the walk's loop: GCC at -O2 kept
 * next_field and put_varint out of line, and inlining them took a sixth off
 * a 240-layer step's key (BENCHMARKS.md, "Key computation"). */
#if defined(__GNUC__)
#define ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define ALWAYS_INLINE inline
#endif

enum { MODULE, COMPUTATION, INSTRUCTION, PROGRAM_SHAPE, SHARDING, NAMED_SHARDING, SCHEDULE,
       FRONTEND };
enum { KEEP, DROP, IDEF, CDEF, IREF, CREF, ROOT, ENTRY, SEQUENCES, ATTRIBUTE, MSG };
#define MAX_CONFIG 256  /* configured field drops and frontend attribute keys, each */

typedef struct { int act; int kind; } Rule;

#define FAIL(c, msg) do { (c)->err = (msg); return -1; } while (0)

static Rule rule(int kind, uint64_t f) {
    Rule keep = {KEEP, 0}, drop = {DROP, 0};
#define R(a) return (Rule){a, 0}
#define M(k) return (Rule){MSG, k}
    switch (kind) {
    case MODULE:
        switch (f) {
        case 1: case 2: case 5: case 17: return drop;
        case 6: R(ENTRY);
        case 3: M(COMPUTATION);
        case 4: M(PROGRAM_SHAPE);
        case 7: M(SCHEDULE);
        case 12: case 14: M(SHARDING);
        case 19: M(FRONTEND);
        }
        break;
    case COMPUTATION:
        switch (f) {
        case 1: return drop;
        case 5: R(CDEF);
        case 6: R(ROOT);
        case 2: M(INSTRUCTION);
        case 4: M(PROGRAM_SHAPE);
        }
        break;
    case INSTRUCTION:
        switch (f) {
        case 1: case 7: return drop;
        case 35: R(IDEF);
        case 36: case 37: R(IREF);
        case 38: R(CREF);
        case 40: case 54: case 55: M(SHARDING);
        case 68: M(FRONTEND);
        }
        break;
    case PROGRAM_SHAPE:
        if (f == 3) return drop;
        break;
    case SHARDING:
        switch (f) {
        case 7: return drop;
        case 5: M(SHARDING);
        case 14: M(NAMED_SHARDING);
        }
        break;
    case NAMED_SHARDING:
        switch (f) {
        case 6: return drop;
        case 1: M(NAMED_SHARDING);
        }
        break;
    case SCHEDULE:
        if (f == 1) R(SEQUENCES);
        break;
    case FRONTEND:
        if (f == 1) R(ATTRIBUTE);
        break;
    }
#undef R
#undef M
    return keep;
}

/* -- output buffer ------------------------------------------------------- */

/* The output goes either into memory (`canonical_hlo`) or, in chunks, into a
 * hashlib object (`canonical_hlo_sha256`): then no buffer ever holds the
 * whole canonical module, and a long run of kept bytes (a large constant) is
 * hashed straight from the input. */
typedef struct {
    PyObject *hasher;
    PyThreadState **ts;  /* the call's thread state, saved while the GIL is released */
} Sink;

typedef struct { uint8_t *d; size_t n, cap; Sink *sink; } Buf;

#define CHUNK (256 << 10)

static int sink_update(Sink *s, const uint8_t *p, size_t n) {
    PyEval_RestoreThread(*s->ts);
    PyObject *view = PyMemoryView_FromMemory((char *)p, (Py_ssize_t)n, PyBUF_READ);
    PyObject *r = view ? PyObject_CallMethod(s->hasher, "update", "O", view) : NULL;
    int ok = r != NULL;
    Py_XDECREF(r);
    Py_XDECREF(view);
    if (!ok) PyErr_Clear();
    *s->ts = PyEval_SaveThread();
    return ok ? 0 : -1;
}

static int flush(Buf *b) {
    if (!b->sink || !b->n) return 0;
    int rc = sink_update(b->sink, b->d, b->n);
    b->n = 0;
    return rc;
}

static int reserve(Buf *b, size_t extra) {
    if (b->n + extra <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->n + extra) cap *= 2;
    uint8_t *d = realloc(b->d, cap);
    if (!d) return -1;
    b->d = d;
    b->cap = cap;
    return 0;
}

static int put(Buf *b, const uint8_t *p, size_t n) {
    if (b->sink && n >= CHUNK) return flush(b) || sink_update(b->sink, p, n);
    if (reserve(b, n)) return -1;
    memcpy(b->d + b->n, p, n);
    b->n += n;
    return b->sink && b->n >= CHUNK ? flush(b) : 0;
}

static ALWAYS_INLINE int put_varint(Buf *b, uint64_t v) {
    if (b->n + 10 > b->cap && reserve(b, 10)) return -1;
    if (v < 0x80) {  /* most are: group tags of low fields, positions in small computations */
        b->d[b->n++] = (uint8_t)v;
        return b->sink && b->n >= CHUNK ? flush(b) : 0;
    }
    while (v >= 0x80) {
        b->d[b->n++] = (uint8_t)((v & 0x7F) | 0x80);
        v >>= 7;
    }
    b->d[b->n++] = (uint8_t)v;
    return b->sink && b->n >= CHUNK ? flush(b) : 0;
}

/* -- wire reading --------------------------------------------------------- */

typedef struct {
    uint64_t num, val;
    int wire;
    const uint8_t *start, *vs, *ve;
} Field;

static ALWAYS_INLINE int rd_varint(const uint8_t **p, const uint8_t *end, uint64_t *out) {
    const uint8_t *q = *p;
    if (q < end && q[0] < 0x80) {  /* most tags and lengths are one byte */
        *out = q[0];
        *p = q + 1;
        return 0;
    }
    if (end - q >= 2 && q[1] < 0x80) {  /* tags of fields 16-2047, ids below 16384 */
        *out = (uint64_t)(q[0] & 0x7F) | (uint64_t)q[1] << 7;
        *p = q + 2;
        return 0;
    }
    uint64_t r = 0;
    int shift = 0;
    for (;;) {
        if (*p >= end || shift > 63) return -1;
        uint8_t b = *(*p)++;
        r |= (uint64_t)(b & 0x7F) << shift;
        shift += 7;
        if (b < 0x80) {
            *out = r;
            return 0;
        }
    }
}

/* 1: a field was read, 0: end of message, -1: malformed. */
static ALWAYS_INLINE int next_field(const uint8_t **p, const uint8_t *end, Field *f) {
    if (*p >= end) return 0;
    uint64_t tag, n;
    f->start = *p;
    if (rd_varint(p, end, &tag)) return -1;
    f->num = tag >> 3;
    f->wire = (int)(tag & 7);
    f->val = 0;
    if (f->num == 0) return -1;
    f->vs = *p;
    switch (f->wire) {
    case VARINT:
        if (rd_varint(p, end, &f->val)) return -1;
        break;
    case I64:
        if (end - *p < 8) return -1;
        *p += 8;
        break;
    case I32:
        if (end - *p < 4) return -1;
        *p += 4;
        break;
    case LEN:
        if (rd_varint(p, end, &n)) return -1;
        f->vs = *p;
        if (n > (uint64_t)(end - *p)) return -1;
        *p += n;
        break;
    default:
        return -1;
    }
    f->ve = *p;
    return 1;
}

/* -- id tables: (computation, raw id) -> position ---------------------------- */

typedef struct { uint64_t raw; int64_t comp; int64_t pos; } Slot;
typedef struct { Slot *s; size_t cap, n; } Map;

static size_t slot_of(const Map *m, int64_t comp, uint64_t raw) {
    /* splitmix64's finalizer over the pair */
    uint64_t h = raw ^ ((uint64_t)comp * 0x9E3779B97F4A7C15ULL);
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ULL;
    h = (h ^ (h >> 27)) * 0x94D049BB133111EBULL;
    h ^= h >> 31;
    size_t i = (size_t)h & (m->cap - 1);
    while (m->s[i].pos >= 0 && !(m->s[i].raw == raw && m->s[i].comp == comp))
        i = (i + 1) & (m->cap - 1);
    return i;
}

static int map_init(Map *m, size_t n) {
    m->cap = 16;
    while (m->cap < 2 * n + 16) m->cap *= 2;
    m->n = 0;
    m->s = malloc(m->cap * sizeof(Slot));
    if (!m->s) return -1;
    for (size_t i = 0; i < m->cap; i++) m->s[i].pos = -1;
    return 0;
}

/* 0: added, 1: duplicate */
static int map_add(Map *m, int64_t comp, uint64_t raw, int64_t pos) {
    size_t i = slot_of(m, comp, raw);
    if (m->s[i].pos >= 0) return 1;
    m->s[i] = (Slot){raw, comp, pos};
    m->n++;
    return 0;
}

static int64_t map_get(const Map *m, int64_t comp, uint64_t raw) {
    return m->s[slot_of(m, comp, raw)].pos;
}

/* map_add that doubles the table when it is half full. -1: out of memory. */
static int map_add_grow(Map *m, int64_t comp, uint64_t raw, int64_t pos) {
    if (2 * (m->n + 1) > m->cap) {
        Map bigger;
        if (map_init(&bigger, m->cap)) return -1;
        for (size_t i = 0; i < m->cap; i++)
            if (m->s[i].pos >= 0) map_add(&bigger, m->s[i].comp, m->s[i].raw, m->s[i].pos);
        free(m->s);
        *m = bigger;
    }
    return map_add(m, comp, raw, pos);
}

/* -- the canonical stream ------------------------------------------------- */

/* A computation whose instruction ids are dense (the usual case) looks them
 * up in an array indexed by id - min; others go through the hash map. */
typedef struct { uint64_t min, span, cap; int32_t *dense; } Comp;

/* Two ways to the same bytes. The single pass registers each instruction and
 * computation as it is written, which is enough when every reference points
 * back (XLA writes operands before users and callees before callers). Anything
 * else (a reference forward or to nothing, ids that are not dense and rising)
 * sets `retry`, and the module is done again in two passes: one that records
 * every position, one that writes. */
typedef struct {
    Map comps;   /* comp = -1 */
    Map instrs;  /* comp = position of the computation (sparse ones; two passes only) */
    Comp *cs;
    size_t ncs;
    const char *err;
    int single, retry;
    PyObject *kernel;     /* NULL, or the hook splitting a tpu_custom_call's backend_config */
    PyObject *rename;     /* NULL, or the hook naming an "xla.sdy." attribute's mesh axes */
    PyThreadState **ts;   /* to take the GIL back for the hook */
    PyObject *hook_error; /* the exception the hook raised (re-raised at the end) */
    /* configuration: fields dropped as kind * 1000 + field, frontend attribute keys */
    long drops[MAX_CONFIG];
    int ndrops;
    const char *attr[MAX_CONFIG];
    Py_ssize_t attr_len[MAX_CONFIG];
    int nattr;
} Ctx;

static int dropped(const Ctx *c, int kind, uint64_t f) {
    for (int i = 0; i < c->ndrops; i++)
        if ((uint64_t)c->drops[i] == (uint64_t)kind * 1000 + f && f < 1000) return 1;
    return 0;
}

static int64_t instr_pos(const Ctx *c, int64_t comp, uint64_t raw) {
    if (comp < 0 || (size_t)comp >= c->ncs) return -1;
    const Comp *k = &c->cs[comp];
    if (k->dense) {
        uint64_t i = raw - k->min;
        return raw >= k->min && i < k->span ? k->dense[i] : -1;
    }
    return c->single ? -1 : map_get(&c->instrs, comp, raw);
}

/* Single pass: instruction `raw` of computation `comp` is at `pos`. */
static int register_instr(Ctx *c, int64_t comp, uint64_t raw, int64_t pos) {
    if ((size_t)comp >= c->ncs) {
        size_t n = c->ncs ? 2 * c->ncs : 64;
        while (n <= (size_t)comp) n *= 2;
        Comp *grown = realloc(c->cs, n * sizeof(Comp));
        if (!grown) FAIL(c, "out of memory");
        memset(grown + c->ncs, 0, (n - c->ncs) * sizeof(Comp));
        c->cs = grown;
        c->ncs = n;
    }
    Comp *k = &c->cs[comp];
    if (!k->dense) {
        k->min = raw;
        k->cap = 16;
        k->dense = malloc(k->cap * sizeof(int32_t));
        if (!k->dense) FAIL(c, "out of memory");
        memset(k->dense, 0xFF, k->cap * sizeof(int32_t));
    }
    uint64_t limit = 4 * (uint64_t)pos + 65536;  /* sparser than this: two passes */
    if (raw < k->min) {  /* ids need not rise (XLA numbers parameters late): move the base */
        uint64_t shift = k->min - raw;
        if (shift > limit || k->span + shift > limit) {
            c->retry = 1;
            FAIL(c, "retry");
        }
        uint64_t cap = k->cap;
        while (cap < k->span + shift) cap *= 2;
        int32_t *moved = malloc(cap * sizeof(int32_t));
        if (!moved) FAIL(c, "out of memory");
        memset(moved, 0xFF, cap * sizeof(int32_t));
        memcpy(moved + shift, k->dense, k->span * sizeof(int32_t));
        free(k->dense);
        k->dense = moved;
        k->cap = cap;
        k->min = raw;
        k->span += shift;
    }
    uint64_t i = raw - k->min;
    if (i > limit) {
        c->retry = 1;
        FAIL(c, "retry");
    }
    if (i >= k->cap) {
        uint64_t cap = 2 * k->cap;
        while (cap <= i) cap *= 2;
        int32_t *grown = realloc(k->dense, cap * sizeof(int32_t));
        if (!grown) FAIL(c, "out of memory");
        memset(grown + k->cap, 0xFF, (cap - k->cap) * sizeof(int32_t));
        k->dense = grown;
        k->cap = cap;
    }
    if (k->dense[i] >= 0) {
        c->retry = 1;  /* a duplicate: the two passes say so */
        FAIL(c, "retry");
    }
    k->dense[i] = (int32_t)pos;
    if (i + 1 > k->span) k->span = i + 1;
    return 0;
}


/* The last value of varint field `num` in a message (0 when absent). */
static int last_varint(Ctx *c, const uint8_t *p, const uint8_t *end, uint64_t num,
                       uint64_t *out) {
    Field f;
    int r;
    *out = 0;
    while ((r = next_field(&p, end, &f)) > 0) {
        if (f.num == num) {
            if (f.wire != VARINT) FAIL(c, "an id field that is not a varint");
            *out = f.val;
        }
    }
    if (r < 0) FAIL(c, "malformed protobuf");
    return 0;
}

/* Record the positions of one computation's instructions. */
static int index_computation(Ctx *c, int64_t cpos, const uint8_t *p, const uint8_t *end,
                             uint64_t **ids, size_t *cap) {
    Field g;
    int r;
    size_t n = 0;
    uint64_t lo = UINT64_MAX, hi = 0, iid;
    while ((r = next_field(&p, end, &g)) > 0) {
        if (g.num != 2) continue;
        if (g.wire != LEN) FAIL(c, "an instruction that is not a message");
        if (last_varint(c, g.vs, g.ve, 35, &iid)) return -1;
        if (n == *cap) {
            *cap = *cap ? 2 * *cap : 1024;
            uint64_t *grown = realloc(*ids, *cap * sizeof(uint64_t));
            if (!grown) FAIL(c, "out of memory");
            *ids = grown;
        }
        (*ids)[n++] = iid;
        if (iid < lo) lo = iid;
        if (iid > hi) hi = iid;
    }
    if (r < 0) FAIL(c, "malformed protobuf");
    Comp *k = &c->cs[cpos];
    if (n && hi - lo < 4 * (uint64_t)n + 64) {
        k->min = lo;
        k->span = hi - lo + 1;
        k->dense = malloc(k->span * sizeof(int32_t));
        if (!k->dense) FAIL(c, "out of memory");
        memset(k->dense, 0xFF, k->span * sizeof(int32_t));  /* -1: no such id */
        for (size_t i = 0; i < n; i++) {
            int32_t *slot = &k->dense[(*ids)[i] - lo];
            if (*slot >= 0) FAIL(c, "duplicate instruction id");
            *slot = (int32_t)i;
        }
    } else {
        for (size_t i = 0; i < n; i++)
            if (map_add(&c->instrs, cpos, (*ids)[i], (int64_t)i))
                FAIL(c, "duplicate instruction id");
    }
    return 0;
}

static int index_module(Ctx *c, const uint8_t *p, const uint8_t *end) {
    Field f, g;
    int r, r2;
    size_t ncomp = 0, ninstr = 0;
    const uint8_t *q = p;
    while ((r = next_field(&q, end, &f)) > 0) {  /* sizes first */
        if (f.num != 3) continue;
        if (f.wire != LEN) FAIL(c, "a computation that is not a message");
        ncomp++;
        const uint8_t *s = f.vs;
        while ((r2 = next_field(&s, f.ve, &g)) > 0)
            if (g.num == 2) ninstr++;
        if (r2 < 0) FAIL(c, "malformed protobuf");
    }
    if (r < 0) FAIL(c, "malformed protobuf");
    if (ncomp == 0) FAIL(c, "no computations: not an HloModuleProto");
    c->cs = calloc(ncomp, sizeof(Comp));
    c->ncs = ncomp;
    if (!c->cs || map_init(&c->comps, ncomp) || map_init(&c->instrs, ninstr))
        FAIL(c, "out of memory");
    int64_t cpos = 0;
    uint64_t *ids = NULL;
    size_t cap = 0;
    int rc = 0;
    while (rc == 0 && (r = next_field(&p, end, &f)) > 0) {
        if (f.num != 3) continue;
        uint64_t cid;
        if (last_varint(c, f.vs, f.ve, 5, &cid)) rc = -1;
        else if (map_add(&c->comps, -1, cid, cpos)) { c->err = "duplicate computation id"; rc = -1; }
        else rc = index_computation(c, cpos++, f.vs, f.ve, &ids, &cap);
    }
    free(ids);
    return rc;
}

/* A reference: its position under its own field number, or its raw value
 * under field number + UNRESOLVED. */
static int put_pos(Buf *o, uint64_t num, uint64_t raw, int64_t pos) {
    if (pos < 0)
        return put_varint(o, ((num + UNRESOLVED) << 3) | VARINT) || put_varint(o, raw);
    return put_varint(o, (num << 3) | VARINT) || put_varint(o, (uint64_t)pos);
}

/* comp >= 0: instruction ids of that computation; -1: computation ids;
 * -2: nothing resolves. */
static int64_t resolve(Ctx *c, int64_t comp, uint64_t raw) {
    int64_t pos = comp == -1 ? map_get(&c->comps, -1, raw) : instr_pos(c, comp, raw);
    if (pos < 0 && c->single) c->retry = 1;
    return pos;
}

static int put_refs(Ctx *c, Buf *o, const Field *f, int64_t comp) {
    if (f->wire == VARINT) {
        if (put_pos(o, f->num, f->val, resolve(c, comp, f->val))) FAIL(c, "out of memory");
        if (c->retry) FAIL(c, "retry");
        return 0;
    }
    if (f->wire != LEN) FAIL(c, "an id field that is not a varint");
    const uint8_t *p = f->vs;
    uint64_t v;
    while (p < f->ve) {
        if (rd_varint(&p, f->ve, &v)) FAIL(c, "malformed protobuf");
        if (put_pos(o, f->num, v, resolve(c, comp, v))) FAIL(c, "out of memory");
    }
    if (c->retry) FAIL(c, "retry");
    return 0;
}

typedef struct { int group; uint64_t num; Buf b; } Entry;

static int entry_cmp(const void *x, const void *y) {
    const Entry *a = x, *b = y;
    if (a->group != b->group) return a->group < b->group ? -1 : 1;
    if (a->num != b->num) return a->num < b->num ? -1 : 1;
    size_t n = a->b.n < b->b.n ? a->b.n : b->b.n;
    int r = memcmp(a->b.d, b->b.d, n);
    if (r) return r;
    return a->b.n < b->b.n ? -1 : (a->b.n > b->b.n ? 1 : 0);
}

static int sequence(Ctx *c, const Field *f, Entry *e) {
    Field g, h;
    int r;
    uint64_t raw = 0;
    const uint8_t *seq = NULL, *seq_end = NULL;
    if (f->wire != LEN) FAIL(c, "a schedule entry that is not a message");
    const uint8_t *p = f->vs;
    while ((r = next_field(&p, f->ve, &g)) > 0) {
        if (g.num == 1 && g.wire == VARINT) raw = g.val;
        else if (g.num == 2 && g.wire == LEN) { seq = g.vs; seq_end = g.ve; }
        else FAIL(c, "unexpected field in a schedule entry");
    }
    if (r < 0) FAIL(c, "malformed protobuf");
    int64_t pos = resolve(c, -1, raw);
    if (c->retry) FAIL(c, "retry");
    Buf *o = &e->b;
    if (put_varint(o, (f->num << 3) | SGROUP) || put_pos(o, 1, raw, pos))
        FAIL(c, "out of memory");
    if (seq) {
        if (put_varint(o, (2 << 3) | SGROUP)) FAIL(c, "out of memory");
        while ((r = next_field(&seq, seq_end, &h)) > 0) {
            if (h.num != 1) FAIL(c, "unexpected field in an instruction sequence");
            if (put_refs(c, o, &h, pos >= 0 ? pos : -2)) return -1;
        }
        if (r < 0) FAIL(c, "malformed protobuf");
        if (put_varint(o, (2 << 3) | EGROUP)) FAIL(c, "out of memory");
    }
    if (put_varint(o, (f->num << 3) | EGROUP)) FAIL(c, "out of memory");
    e->group = pos >= 0 ? 0 : 1;
    e->num = pos >= 0 ? (uint64_t)pos : raw;
    return 0;
}

static int emit(Ctx *c, int kind, const uint8_t *p, const uint8_t *end, Buf *o, int64_t comp,
                int64_t ipos, int depth);

/* A new zeroed entry at the end of *es (NULL when out of memory). */
static Entry *push_entry(Entry **es, size_t *n, size_t *cap) {
    if (*n == *cap) {
        size_t grown_cap = *cap ? 2 * *cap : 16;
        Entry *grown = realloc(*es, grown_cap * sizeof(Entry));
        if (!grown) return NULL;
        *es = grown;
        *cap = grown_cap;
    }
    memset(&(*es)[*n], 0, sizeof(Entry));
    return &(*es)[(*n)++];
}

/* A frontend attribute's key (the map entry's field 1): 0, or -1 malformed. */
static int attribute_key(const Field *f, const uint8_t **key, size_t *klen) {
    const uint8_t *q = f->vs;
    Field g;
    int r;
    *key = NULL;
    *klen = 0;
    while ((r = next_field(&q, f->ve, &g)) > 0)
        if (g.num == 1 && g.wire == LEN) {
            *key = g.vs;
            *klen = (size_t)(g.ve - g.vs);
        }
    return r < 0 ? -1 : 0;
}

/* Is this frontend attribute's key on the ignore list? -1: malformed. */
static int ignored_attribute(const Ctx *c, const Field *f) {
    const uint8_t *key;
    size_t klen;
    if (attribute_key(f, &key, &klen)) return -1;
    for (int i = 0; i < c->nattr; i++)
        if ((size_t)c->attr_len[i] == klen && (klen == 0 || memcmp(c->attr[i], key, klen) == 0))
            return 1;
    return 0;
}

/* A hook raised (the GIL held): its exception kept, re-raised at the end. */
static void hook_failed(Ctx *c, const char *why) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    c->hook_error = value;
    Py_XDECREF(type);
    Py_XDECREF(tb);
    c->err = why;
}

/* Is this frontend attribute one of Shardy's ("xla.sdy." key)? -1: malformed. */
static int sdy_attribute(const Field *f) {
    const uint8_t *key;
    size_t klen;
    if (attribute_key(f, &key, &klen)) return -1;
    return klen >= 8 && memcmp(key, "xla.sdy.", 8) == 0;
}

/* A Shardy attribute (the whole map entry) through the rename hook
 * (hlocanon.axis_renamer), its bytes into `b`: 0, or -1 failed. */
static __attribute__((noinline)) int renamed(Ctx *c, const Field *f, Buf *b) {
    PyEval_RestoreThread(*c->ts);
    PyObject *arg = PyBytes_FromStringAndSize((const char *)f->start,
                                              (Py_ssize_t)(f->ve - f->start));
    PyObject *r = arg ? PyObject_CallOneArg(c->rename, arg) : NULL;
    Py_XDECREF(arg);
    int rc = -1;
    if (!r) {
        hook_failed(c, "the rename hook failed");
    } else if (!PyBytes_Check(r)) {
        c->err = "the rename hook must return bytes";
    } else if (put(b, (const uint8_t *)PyBytes_AS_STRING(r), (size_t)PyBytes_GET_SIZE(r))) {
        c->err = "out of memory";
    } else {
        rc = 0;
    }
    Py_XDECREF(r);
    *c->ts = PyEval_SaveThread();
    return rc;
}

/* A tpu_custom_call's backend_config through the kernel hook (worker/keylib/mosaic.py):
 * 1 written as a group under field 43 + KERNEL ({1: before, 2: kernel digest,
 * 3: after}), 0 kept as it is (the hook said None), -1 failed. */
#define KERNEL ((uint64_t)1 << 27)
static __attribute__((noinline)) int kernel_config(Ctx *c, const Field *f, Buf *o) {
    PyEval_RestoreThread(*c->ts);
    PyObject *arg = PyBytes_FromStringAndSize((const char *)f->vs, (Py_ssize_t)(f->ve - f->vs));
    PyObject *r = arg ? PyObject_CallOneArg(c->kernel, arg) : NULL;
    Py_XDECREF(arg);
    int rc = -1;
    if (!r) {
        hook_failed(c, "the kernel hook failed");
    } else if (r == Py_None) {
        rc = 0;
    } else if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 3 ||
               !PyBytes_Check(PyTuple_GET_ITEM(r, 0)) || !PyBytes_Check(PyTuple_GET_ITEM(r, 1)) ||
               !PyBytes_Check(PyTuple_GET_ITEM(r, 2))) {
        c->err = "the kernel hook must return None or 3 bytes";
    } else {
        rc = 1;
    }
    *c->ts = PyEval_SaveThread();
    /* Written without the GIL (a flush takes it itself); `r` keeps the bytes alive. */
    if (rc == 1) {
        if (put_varint(o, ((f->num + KERNEL) << 3) | SGROUP)) rc = -1;
        for (int i = 0; rc == 1 && i < 3; i++) {
            PyObject *b = PyTuple_GET_ITEM(r, i);
            size_t n = (size_t)PyBytes_GET_SIZE(b);
            if (put_varint(o, ((uint64_t)(i + 1) << 3) | LEN) || put_varint(o, n) ||
                put(o, (const uint8_t *)PyBytes_AS_STRING(b), n))
                rc = -1;
        }
        if (rc == 1 && put_varint(o, ((f->num + KERNEL) << 3) | EGROUP)) rc = -1;
        if (rc < 0) c->err = "out of memory";
    }
    if (r) {
        PyEval_RestoreThread(*c->ts);
        Py_DECREF(r);
        *c->ts = PyEval_SaveThread();
    }
    return rc;
}

/* An instruction's custom_call_target (28) or backend_config (43), when a
 * kernel hook is set: 1 the config was written split, 0 keep the field as it
 * is, -1 failed. *kept is the caller's run of kept fields not yet copied. */
static __attribute__((noinline)) int kernel_field(Ctx *c, const Field *f, Buf *o,
                                                  const uint8_t **kept, int *tpu_call) {
    if (f->num == 28) {
        *tpu_call = f->ve - f->vs == 15 && memcmp(f->vs, "tpu_custom_call", 15) == 0;
        return 0;
    }
    if (!*tpu_call) return 0;
    if (*kept && put(o, *kept, (size_t)(f->start - *kept))) {
        c->err = "out of memory";
        return -1;
    }
    *kept = NULL;
    return kernel_config(c, f, o);
}

static int emit_sorted_entries(Ctx *c, Entry *es, size_t n, Buf *o) {
    qsort(es, n, sizeof(Entry), entry_cmp);
    for (size_t i = 0; i < n; i++)
        if (put(o, es[i].b.d, es[i].b.n)) FAIL(c, "out of memory");
    return 0;
}

static int emit(Ctx *c, int kind, const uint8_t *p, const uint8_t *end, Buf *o, int64_t comp,
                int64_t ipos, int depth) {
    Field f;
    int r, rc = -1;
    uint64_t tail_raw = 0, def_raw = 0;
    int64_t ncomp = 0, ninstr = 0;
    Entry *es = NULL;
    size_t nes = 0, capes = 0;
    const uint8_t *kept = NULL;  /* start of the run of kept fields not yet copied */
    int tpu_call = 0;            /* custom_call_target "tpu_custom_call" seen */
    const int watch = kind == INSTRUCTION && c->kernel != NULL;  /* for kernel calls */
    if (depth > MAX_DEPTH) FAIL(c, "messages nested too deeply");
    while ((r = next_field(&p, end, &f)) > 0) {
        Rule ru = rule(kind, f.num);
        if (c->ndrops && dropped(c, kind, f.num)) ru.act = DROP;
        if (ru.act == KEEP) {
            if (__builtin_expect(watch, 0) && (f.num == 28 || f.num == 43) && f.wire == LEN) {
                int k = kernel_field(c, &f, o, &kept, &tpu_call);
                if (k < 0) goto out;
                if (k == 1) continue;
            }
            if (!kept) kept = f.start;
            continue;
        }
        if (kept) {  /* one copy for a whole run of kept fields */
            if (put(o, kept, (size_t)(f.start - kept))) { c->err = "out of memory"; goto out; }
            kept = NULL;
        }
        switch (ru.act) {
        case DROP:
            break;
        case IDEF: case CDEF:
            if (f.wire != VARINT) { c->err = "an id field that is not a varint"; goto out; }
            def_raw = f.val;
            break;
        case MSG: {
            if (f.wire != LEN) { c->err = "a message field that is not a message"; goto out; }
            int64_t sub = comp, sub_ipos = -1;
            if (kind == MODULE && f.num == 3) sub = ncomp++;
            if (kind == COMPUTATION && f.num == 2) sub_ipos = ninstr++;
            if (put_varint(o, (f.num << 3) | SGROUP)) { c->err = "out of memory"; goto out; }
            /* An empty message writes nothing of its own, except the kinds that
             * end with a reference or a registration (the commonest: an
             * instruction's empty frontend attributes). */
            int has_tail = ru.kind == MODULE || ru.kind == COMPUTATION || ru.kind == INSTRUCTION;
            if ((f.ve > f.vs || has_tail || depth + 1 > MAX_DEPTH) &&
                emit(c, ru.kind, f.vs, f.ve, o, sub, sub_ipos, depth + 1))
                goto out;
            if (put_varint(o, (f.num << 3) | EGROUP)) { c->err = "out of memory"; goto out; }
            break;
        }
        case ROOT: case ENTRY:
            if (f.wire != VARINT) { c->err = "an id field that is not a varint"; goto out; }
            tail_raw = f.val;
            break;
        case IREF:
            if (put_refs(c, o, &f, comp >= 0 ? comp : -2)) goto out;
            break;
        case CREF:
            if (put_refs(c, o, &f, -1)) goto out;
            break;
        case SEQUENCES: {
            Entry *e = push_entry(&es, &nes, &capes);
            if (!e) { c->err = "out of memory"; goto out; }
            if (sequence(c, &f, e)) goto out;
            break;
        }
        case ATTRIBUTE: {  /* a map entry, kept as it is unless ignored; sorted by bytes */
            if (f.wire != LEN) { c->err = "a frontend attribute that is not a message"; goto out; }
            if (c->nattr) {
                int ignored = ignored_attribute(c, &f);
                if (ignored < 0) { c->err = "malformed protobuf"; goto out; }
                if (ignored) break;
            }
            Entry *e = push_entry(&es, &nes, &capes);
            if (!e) { c->err = "out of memory"; goto out; }
            if (c->rename) {
                int sdy = sdy_attribute(&f);
                if (sdy < 0) { c->err = "malformed protobuf"; goto out; }
                if (sdy) {
                    if (renamed(c, &f, &e->b)) goto out;
                    break;
                }
            }
            if (put(&e->b, f.start, (size_t)(f.ve - f.start))) {
                c->err = "out of memory";
                goto out;
            }
            break;
        }
        }
    }
    if (r < 0) { c->err = "malformed protobuf"; goto out; }
    if (kept && put(o, kept, (size_t)(end - kept))) { c->err = "out of memory"; goto out; }
    if (nes && emit_sorted_entries(c, es, nes, o)) goto out;
    if (c->single && kind == INSTRUCTION && register_instr(c, comp, def_raw, ipos)) goto out;
    if (kind == COMPUTATION) {
        if (put_pos(o, 6, tail_raw, resolve(c, comp, tail_raw))) {
            c->err = "out of memory";
            goto out;
        }
        if (c->retry) { c->err = "retry"; goto out; }
        if (c->single) {
            int added = map_add_grow(&c->comps, -1, def_raw, comp);
            if (added < 0) { c->err = "out of memory"; goto out; }
            if (added > 0) { c->retry = 1; c->err = "retry"; goto out; }
        }
    } else if (kind == MODULE) {
        if (put_pos(o, 6, tail_raw, resolve(c, -1, tail_raw))) {
            c->err = "out of memory";
            goto out;
        }
        if (c->retry) { c->err = "retry"; goto out; }
        if (ncomp == 0) { c->err = "no computations: not an HloModuleProto"; goto out; }
    }
    rc = 0;
out:
    for (size_t i = 0; i < nes; i++) free(es[i].b.d);
    free(es);
    return rc;
}

/* Frees the tables and resets them; the configuration stays. */
static void ctx_free(Ctx *c) {
    free(c->comps.s);
    free(c->instrs.s);
    for (size_t i = 0; c->cs && i < c->ncs; i++) free(c->cs[i].dense);
    free(c->cs);
    memset(&c->comps, 0, sizeof(c->comps));
    memset(&c->instrs, 0, sizeof(c->instrs));
    c->cs = NULL;
    c->ncs = 0;
    c->err = NULL;
    c->single = c->retry = 0;
}

/* `fresh` (a second sink) takes over when the single pass has to be redone. */
static int run(Ctx *c, const uint8_t *p, const uint8_t *end, Buf *o, Sink *fresh) {
    size_t want = o->sink ? CHUNK + 4096 : (size_t)(end - p) + 4096;  /* rarely longer */
    if (reserve(o, want)) FAIL(c, "out of memory");
    c->single = 1;
    if (map_init(&c->comps, 64)) FAIL(c, "out of memory");
    if (emit(c, MODULE, p, end, o, -1, -1, 0) == 0) return flush(o);
    if (!c->retry) return -1;
    ctx_free(c);
    o->n = 0;
    if (o->sink) o->sink = fresh;
    if (index_module(c, p, end)) return -1;
    if (emit(c, MODULE, p, end, o, -1, -1, 0)) return -1;
    return flush(o);
}

/* Configuration from Python: drops (ints, kind * 1000 + field) and frontend
 * attribute keys (bytes), both sequences. The keys' bytes stay owned by
 * `attributes`, which the caller holds for the whole call. */
static int configure(Ctx *c, PyObject *drops, PyObject *attributes) {
    if (!drops) return 0;
    PyObject *d = PySequence_Fast(drops, "drops must be a sequence of ints");
    if (!d) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(d);
    if (n > MAX_CONFIG) n = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        c->drops[i] = PyLong_AsLong(PySequence_Fast_GET_ITEM(d, i));
        if (c->drops[i] == -1 && PyErr_Occurred()) n = -2;
    }
    Py_DECREF(d);
    if (n < 0) {
        if (n == -1) PyErr_SetString(PyExc_ValueError, "too many fields to drop");
        return -1;
    }
    c->ndrops = (int)n;
    if (!attributes) return 0;
    PyObject *a = PySequence_Fast(attributes, "attributes must be a sequence of bytes");
    if (!a) return -1;
    n = PySequence_Fast_GET_SIZE(a);
    int rc = 0;
    if (n > MAX_CONFIG) {
        PyErr_SetString(PyExc_ValueError, "too many attributes to ignore");
        rc = -1;
    }
    for (Py_ssize_t i = 0; rc == 0 && i < n; i++) {
        char *p;
        if (PyBytes_AsStringAndSize(PySequence_Fast_GET_ITEM(a, i), &p, &c->attr_len[i]) < 0)
            rc = -1;
        c->attr[i] = p;
    }
    if (rc == 0) c->nattr = (int)n;
    Py_DECREF(a);  /* the items live on in `attributes` */
    return rc;
}

/* Canonical bytes (hasher NULL), or the sha256 hex digest of them. */
static PyObject *canonical(PyObject *args, int digest) {
    PyObject *arg, *drops = NULL, *attributes = NULL, *kernel = Py_None, *rename = Py_None;
    if (!PyArg_ParseTuple(args, "O|OOOO", &arg, &drops, &attributes, &kernel, &rename))
        return NULL;
    if ((kernel != Py_None && !PyCallable_Check(kernel)) ||
        (rename != Py_None && !PyCallable_Check(rename))) {
        PyErr_SetString(PyExc_TypeError, "kernel and rename must be callable or None");
        return NULL;
    }
    Ctx c;
    memset(&c, 0, sizeof(c));
    if (configure(&c, drops, attributes) < 0) return NULL;
    c.kernel = kernel == Py_None ? NULL : kernel;
    c.rename = rename == Py_None ? NULL : rename;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    Buf o = {0};
    Sink sinks[2] = {{NULL, NULL}, {NULL, NULL}};
    PyObject *result = NULL;
    if (digest) {
        PyObject *hashlib = PyImport_ImportModule("hashlib");
        for (int i = 0; hashlib && i < 2; i++)
            sinks[i].hasher = PyObject_CallMethod(hashlib, "sha256", NULL);
        Py_XDECREF(hashlib);
        if (!sinks[0].hasher || !sinks[1].hasher) goto done;
        o.sink = &sinks[0];
    }
    const uint8_t *p = view.buf, *end = p + view.len;
    PyThreadState *ts = PyEval_SaveThread();
    sinks[0].ts = sinks[1].ts = c.ts = &ts;
    int rc = run(&c, p, end, &o, &sinks[1]);
    PyEval_RestoreThread(ts);
    if (rc != 0 && c.hook_error)
        PyErr_SetObject((PyObject *)Py_TYPE(c.hook_error), c.hook_error);
    else if (rc != 0)
        PyErr_SetString(PyExc_ValueError, c.err ? c.err : "malformed HloModuleProto");
    else if (digest)
        result = PyObject_CallMethod(o.sink->hasher, "hexdigest", NULL);
    else
        result = PyBytes_FromStringAndSize((const char *)o.d, (Py_ssize_t)o.n);
done:
    PyBuffer_Release(&view);
    ctx_free(&c);
    free(o.d);
    Py_XDECREF(sinks[0].hasher);
    Py_XDECREF(sinks[1].hasher);
    Py_XDECREF(c.hook_error);
    return result;
}

static PyObject *canonical_hlo(PyObject *self, PyObject *args) {
    (void)self;
    return canonical(args, 0);
}

static PyObject *canonical_hlo_sha256(PyObject *self, PyObject *args) {
    (void)self;
    return canonical(args, 1);
}

static PyMethodDef methods[] = {
    {"canonical_hlo", canonical_hlo, METH_VARARGS,
     "canonical_hlo(data, drops=(), attributes=(), kernel=None, rename=None): canonical bytes of a "
     "serialized HloModuleProto (see hlocanon.py)."},
    {"canonical_hlo_sha256", canonical_hlo_sha256, METH_VARARGS,
     "sha256 hex digest of canonical_hlo(data), without holding the canonical bytes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hlocanon", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__hlocanon(void) { return PyModule_Create(&module); }
