/* The canonical program stream of an in-memory MLIR module, written by one
 * walk over MLIR's C API (the same bytes as worker/keylib/mlirwalk.py, the
 * reference; tests/test_mlircanon.py holds them equal).
 *
 * jaxlib does not export MLIR's C API: its functions are in libjax_common.so
 * as local symbols. `symbols(path)` finds them in that file's ELF symbol
 * table (.dynsym first, then .symtab); `bind(path, locations)` reads just
 * those entries again, checks each is the function of that name, and adds
 * the library's load address. Nothing
 * here is called before every symbol is found, and worker/keylib/mlircanon.py uses
 * this module only after a self-test in a separate process matched the
 * reference for this exact library file: a jaxlib whose functions changed
 * shape costs a slower key, never a crashed JAX process.
 *
 * The stream (see mlircanon.py for the grammar) interns identifiers, types
 * and attributes: their first occurrence writes their content, later ones an
 * index. Types and attributes are uniqued by the MLIR context, so pointer
 * identity is content identity and each distinct one is printed once. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct { const void *ptr; } Ptr;
typedef Ptr MlirOperation, MlirModule, MlirIdentifier, MlirValue, MlirType, MlirAttribute,
    MlirBlock, MlirRegion;
typedef struct { const char *data; size_t length; } MlirStringRef;
typedef struct { MlirIdentifier name; MlirAttribute attribute; } MlirNamedAttribute;
typedef void (*MlirStringCallback)(MlirStringRef, void *);

#define API(X) \
  X(MlirOperation, mlirModuleGetOperation, (MlirModule)) \
  X(MlirIdentifier, mlirOperationGetName, (MlirOperation)) \
  X(MlirStringRef, mlirIdentifierStr, (MlirIdentifier)) \
  X(intptr_t, mlirOperationGetNumOperands, (MlirOperation)) \
  X(MlirValue, mlirOperationGetOperand, (MlirOperation, intptr_t)) \
  X(intptr_t, mlirOperationGetNumResults, (MlirOperation)) \
  X(MlirValue, mlirOperationGetResult, (MlirOperation, intptr_t)) \
  X(MlirType, mlirValueGetType, (MlirValue)) \
  X(intptr_t, mlirOperationGetNumAttributes, (MlirOperation)) \
  X(MlirNamedAttribute, mlirOperationGetAttribute, (MlirOperation, intptr_t)) \
  X(MlirAttribute, mlirOperationGetAttributeByName, (MlirOperation, MlirStringRef)) \
  X(intptr_t, mlirOperationGetNumSuccessors, (MlirOperation)) \
  X(MlirBlock, mlirOperationGetSuccessor, (MlirOperation, intptr_t)) \
  X(intptr_t, mlirOperationGetNumRegions, (MlirOperation)) \
  X(MlirRegion, mlirOperationGetRegion, (MlirOperation, intptr_t)) \
  X(MlirBlock, mlirRegionGetFirstBlock, (MlirRegion)) \
  X(MlirBlock, mlirBlockGetNextInRegion, (MlirBlock)) \
  X(intptr_t, mlirBlockGetNumArguments, (MlirBlock)) \
  X(MlirValue, mlirBlockGetArgument, (MlirBlock, intptr_t)) \
  X(MlirOperation, mlirBlockGetFirstOperation, (MlirBlock)) \
  X(MlirOperation, mlirOperationGetNextInBlock, (MlirOperation)) \
  X(void, mlirAttributePrint, (MlirAttribute, MlirStringCallback, void *)) \
  X(void, mlirTypePrint, (MlirType, MlirStringCallback, void *)) \
  X(bool, mlirAttributeIsAFlatSymbolRef, (MlirAttribute)) \
  X(MlirStringRef, mlirFlatSymbolRefAttrGetValue, (MlirAttribute)) \
  X(bool, mlirAttributeIsAArray, (MlirAttribute)) \
  X(intptr_t, mlirArrayAttrGetNumElements, (MlirAttribute)) \
  X(MlirAttribute, mlirArrayAttrGetElement, (MlirAttribute, intptr_t)) \
  X(bool, mlirAttributeIsADictionary, (MlirAttribute)) \
  X(intptr_t, mlirDictionaryAttrGetNumElements, (MlirAttribute)) \
  X(MlirNamedAttribute, mlirDictionaryAttrGetElement, (MlirAttribute, intptr_t)) \
  X(bool, mlirAttributeIsAString, (MlirAttribute)) \
  X(MlirStringRef, mlirStringAttrGetValue, (MlirAttribute)) \
  X(bool, mlirAttributeIsADenseIntElements, (MlirAttribute)) \
  X(bool, mlirAttributeIsADenseFPElements, (MlirAttribute)) \
  X(bool, mlirDenseElementsAttrIsSplat, (MlirAttribute)) \
  X(const void *, mlirDenseElementsAttrGetRawData, (MlirAttribute)) \
  X(int64_t, mlirElementsAttrGetNumElements, (MlirAttribute)) \
  X(MlirType, mlirAttributeGetType, (MlirAttribute)) \
  X(MlirType, mlirShapedTypeGetElementType, (MlirType)) \
  X(bool, mlirTypeIsAInteger, (MlirType)) \
  X(unsigned, mlirIntegerTypeGetWidth, (MlirType)) \
  X(bool, mlirTypeIsAF16, (MlirType)) \
  X(bool, mlirTypeIsAF32, (MlirType)) \
  X(bool, mlirTypeIsAF64, (MlirType))

#define DECLARE(ret, name, args) static ret(*p_##name) args;
API(DECLARE)
#define NAME(ret, name, args) #name,
static const char *const api_names[] = {API(NAME)};
#define NAPI (sizeof api_names / sizeof api_names[0])
static void *api_addr[NAPI];
static int bound;

/* ---- finding the functions ------------------------------------------------ */

typedef struct { const char *path; uintptr_t base; int found; } BaseQuery;

static int find_base(struct dl_phdr_info *info, size_t size, void *data) {
  (void)size;
  BaseQuery *q = data;
  const char *n = info->dlpi_name;
  if (n && n[0]) {
    char real[4096];
    if (realpath(n, real) && strcmp(real, q->path) == 0) {
      q->base = (uintptr_t)info->dlpi_addr;
      q->found = 1;
      return 1;
    }
  }
  return 0;
}

static int api_index(const char *name) {
  if (strncmp(name, "mlir", 4) != 0) return -1;
  for (size_t i = 0; i < NAPI; i++)
    if (strcmp(name, api_names[i]) == 0) return (int)i;
  return -1;
}

/* Where each API function's symbol is (section << LOC_SHIFT | index), from
 * the tables of `type` (SHT_DYNSYM or SHT_SYMTAB) in a mapped ELF file. */
#define LOC_SHIFT 40
static void scan_symbols(const uint8_t *img, size_t size, uint32_t type, uint64_t *locs) {
  const Elf64_Ehdr *eh = (const Elf64_Ehdr *)img;
  if (eh->e_shoff == 0 || eh->e_shoff + (uint64_t)eh->e_shnum * sizeof(Elf64_Shdr) > size) return;
  const Elf64_Shdr *sh = (const Elf64_Shdr *)(img + eh->e_shoff);
  for (unsigned i = 0; i < eh->e_shnum; i++) {
    if (sh[i].sh_type != type || sh[i].sh_link >= eh->e_shnum) continue;
    const Elf64_Shdr *str = &sh[sh[i].sh_link];
    if (sh[i].sh_offset + sh[i].sh_size > size || str->sh_offset + str->sh_size > size) continue;
    const Elf64_Sym *sym = (const Elf64_Sym *)(img + sh[i].sh_offset);
    size_t n = sh[i].sh_size / sizeof(Elf64_Sym);
    const char *names = (const char *)(img + str->sh_offset);
    for (size_t k = 0; k < n; k++) {
      if (ELF64_ST_TYPE(sym[k].st_info) != STT_FUNC || sym[k].st_value == 0 ||
          sym[k].st_shndx == SHN_UNDEF || sym[k].st_name >= str->sh_size)
        continue;
      int idx = api_index(names + sym[k].st_name);
      if (idx >= 0 && locs[idx] == 0) locs[idx] = ((uint64_t)i << LOC_SHIFT) | k;
    }
  }
}

/* symbols(path) -> where the API's symbols are in that ELF file, in
 * api_names order. Reads the file's symbol tables (for libjax_common.so,
 * ~120 MB of names): the self-test does this once per build, and JAX
 * processes bind the locations its verdict records. */
static PyObject *symbols(PyObject *self, PyObject *args) {
  (void)self;
  const char *path;
  if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
  int fd = open(path, O_RDONLY);
  if (fd < 0) return PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
  struct stat st;
  if (fstat(fd, &st) != 0 || (size_t)st.st_size < sizeof(Elf64_Ehdr)) {
    close(fd);
    PyErr_Format(PyExc_ValueError, "%s: not an ELF file", path);
    return NULL;
  }
  size_t size = (size_t)st.st_size;
  const uint8_t *img = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (img == MAP_FAILED) return PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
  uint64_t locs[NAPI] = {0};
  if (memcmp(img, ELFMAG, SELFMAG) == 0 && img[EI_CLASS] == ELFCLASS64) {
    Py_BEGIN_ALLOW_THREADS
    scan_symbols(img, size, SHT_DYNSYM, locs);
    scan_symbols(img, size, SHT_SYMTAB, locs);
    Py_END_ALLOW_THREADS
  }
  munmap((void *)img, size);
  PyObject *out = PyList_New(NAPI);
  if (!out) return NULL;
  for (size_t i = 0; i < NAPI; i++) {
    if (locs[i] == 0) {
      Py_DECREF(out);
      PyErr_Format(PyExc_LookupError, "%s has no %s", path, api_names[i]);
      return NULL;
    }
    PyList_SET_ITEM(out, i, PyLong_FromUnsignedLongLong(locs[i]));
  }
  return out;
}

static int read_at(int fd, void *buf, size_t n, uint64_t off) {
  return pread(fd, buf, n, (off_t)off) == (ssize_t)n ? 0 : -1;
}

/* The value of the symbol at `loc`, after checking that it is a defined
 * function named `want`: a location from a verdict file can only ever name
 * the library's own function of that name. 0 when it is not. */
static uint64_t checked_value(int fd, const Elf64_Ehdr *eh, const Elf64_Shdr *sh, uint64_t loc,
                              const char *want) {
  uint64_t sec = loc >> LOC_SHIFT, k = loc & ((1ull << LOC_SHIFT) - 1);
  if (sec >= eh->e_shnum) return 0;
  const Elf64_Shdr *t = &sh[sec];
  if ((t->sh_type != SHT_SYMTAB && t->sh_type != SHT_DYNSYM) || t->sh_link >= eh->e_shnum ||
      k >= t->sh_size / sizeof(Elf64_Sym))
    return 0;
  Elf64_Sym sym;
  if (read_at(fd, &sym, sizeof sym, t->sh_offset + k * sizeof sym)) return 0;
  if (ELF64_ST_TYPE(sym.st_info) != STT_FUNC || sym.st_value == 0 || sym.st_shndx == SHN_UNDEF)
    return 0;
  const Elf64_Shdr *str = &sh[t->sh_link];
  size_t n = strlen(want) + 1;  /* the name and its terminator */
  char name[128];
  if (n > sizeof name || sym.st_name + n > str->sh_size ||
      read_at(fd, name, n, str->sh_offset + sym.st_name) || memcmp(name, want, n) != 0)
    return 0;
  return sym.st_value;
}

/* bind(path, locations): the API at the library's load address. */
static PyObject *bind(PyObject *self, PyObject *args) {
  (void)self;
  const char *path;
  PyObject *list;
  if (!PyArg_ParseTuple(args, "sO!", &path, &PyList_Type, &list)) return NULL;
  if ((size_t)PyList_GET_SIZE(list) != NAPI) {
    PyErr_Format(PyExc_ValueError, "expected %d symbol locations", (int)NAPI);
    return NULL;
  }
  uint64_t locs[NAPI], values[NAPI];
  for (size_t i = 0; i < NAPI; i++) {
    locs[i] = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(list, i));
    if (PyErr_Occurred()) return NULL;
  }
  char real[4096];
  if (!realpath(path, real)) return PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
  BaseQuery q = {real, 0, 0};
  dl_iterate_phdr(find_base, &q);
  if (!q.found) {
    PyErr_Format(PyExc_LookupError, "%s is not loaded in this process", real);
    return NULL;
  }
  int fd = open(real, O_RDONLY);
  if (fd < 0) return PyErr_SetFromErrnoWithFilename(PyExc_OSError, real);
  Elf64_Ehdr eh;
  Elf64_Shdr *sh = NULL;
  const char *bad = NULL;
  if (read_at(fd, &eh, sizeof eh, 0) || memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0 ||
      eh.e_ident[EI_CLASS] != ELFCLASS64 || eh.e_shentsize != sizeof(Elf64_Shdr) ||
      !(sh = malloc((size_t)eh.e_shnum * sizeof *sh)) ||
      read_at(fd, sh, (size_t)eh.e_shnum * sizeof *sh, eh.e_shoff)) {
    bad = "its section headers cannot be read";
  }
  for (size_t i = 0; i < NAPI && !bad; i++) {
    values[i] = checked_value(fd, &eh, sh, locs[i], api_names[i]);
    if (values[i] == 0) bad = api_names[i];
  }
  free(sh);
  close(fd);
  if (bad) {
    PyErr_Format(PyExc_ValueError, "%s: the recorded symbol locations do not hold %s", real, bad);
    return NULL;
  }
  for (size_t i = 0; i < NAPI; i++) api_addr[i] = (void *)(q.base + values[i]);
  size_t i = 0;
#define ASSIGN(ret, name, args) memcpy(&p_##name, &api_addr[i++], sizeof(void *));
  API(ASSIGN)
  bound = 1;
  Py_RETURN_NONE;
}

/* ---- output: hashed in chunks, never held whole ------------------------------ */

#define CHUNK (256 * 1024)
typedef struct {
  uint8_t *d;
  size_t n, cap;
  PyObject *hasher;
  int failed;
} Out;

static int out_update(Out *o, const void *p, size_t n) {
  if (n == 0) return 0;
  PyObject *view = PyMemoryView_FromMemory((char *)p, (Py_ssize_t)n, PyBUF_READ);
  PyObject *r = view ? PyObject_CallMethod(o->hasher, "update", "O", view) : NULL;
  Py_XDECREF(view);
  if (!r) { o->failed = 1; return -1; }
  Py_DECREF(r);
  return 0;
}

static int out_flush(Out *o) {
  int rc = out_update(o, o->d, o->n);
  o->n = 0;
  return rc;
}

static void put(Out *o, const void *p, size_t n) {
  if (o->failed) return;
  if (o->n + n > o->cap && out_flush(o)) return;
  if (n >= o->cap) { out_update(o, p, n); return; }
  memcpy(o->d + o->n, p, n);
  o->n += n;
}

static void put_byte(Out *o, uint8_t b) {
  if (o->n == o->cap && out_flush(o)) return;
  if (!o->failed) o->d[o->n++] = b;
}

static void put_varint(Out *o, uint64_t v) {
  if (v < 0x80 && o->n < o->cap && !o->failed) {  /* most are one byte */
    o->d[o->n++] = (uint8_t)v;
    return;
  }
  uint8_t b[10];
  int n = 0;
  do {
    b[n] = v & 0x7f;
    v >>= 7;
    if (v) b[n] |= 0x80;
    n++;
  } while (v);
  put(o, b, (size_t)n);
}

static void put_str(Out *o, const char *p, size_t n) {
  put_varint(o, n);
  put(o, p, n);
}

/* ---- pointer -> index tables (open addressing) --------------------------------- */

typedef struct { const void *key; uint64_t val; } Slot;  /* one cache line holds both */
typedef struct {
  Slot *slots;
  size_t cap, n;
} Table;

/* A pointer's bits mixed (Fibonacci hashing): tables take bits 20 and up,
 * the recent-value cache the top 12, a pending batch's mask the top 6. */
static inline uint64_t mix(const void *k) {
  return (uint64_t)(uintptr_t)k * 0x9E3779B97F4A7C15ull;
}

static size_t slot_of(const void *k, size_t cap) {
  return (size_t)(mix(k) >> 20) & (cap - 1);
}

static int table_init(Table *t, size_t cap) {
  t->cap = cap;
  t->n = 0;
  t->slots = calloc(cap, sizeof(Slot));
  return t->slots ? 0 : -1;
}

static void table_free(Table *t) { free(t->slots); }

/* The index of k, or -1. */
static int64_t table_get(const Table *t, const void *k) {
  for (size_t i = slot_of(k, t->cap);; i = (i + 1) & (t->cap - 1)) {
    if (t->slots[i].key == k) return (int64_t)t->slots[i].val;
    if (!t->slots[i].key) return -1;
  }
}

/* k, known to be absent, at its slot; the table has room. */
static void table_insert(Table *t, const void *k, uint64_t v) {
  size_t i = slot_of(k, t->cap);
  while (t->slots[i].key) i = (i + 1) & (t->cap - 1);
  t->slots[i].key = k;
  t->slots[i].val = v;
  t->n++;
}

/* Room for `more` keys at a load of at most one half. */
static int table_reserve(Table *t, size_t more) {
  if (2 * (t->n + more) <= t->cap) return 0;
  size_t cap = t->cap;
  while (2 * (t->n + more) > cap) cap *= 2;
  Table bigger;
  if (table_init(&bigger, cap)) return -1;
  for (size_t i = 0; i < t->cap; i++)
    if (t->slots[i].key) table_insert(&bigger, t->slots[i].key, t->slots[i].val);
  table_free(t);
  *t = bigger;
  return 0;
}

static int table_put(Table *t, const void *k, uint64_t v) {
  if (table_reserve(t, 1)) return -1;
  table_insert(t, k, v);
  return 0;
}

/* ---- the walk ------------------------------------------------------------------ */

#define MAX_DEPTH 200  /* operations in regions, or attributes in attributes (as mlircanon.py) */
#define RESOURCE_REFUSED "the module holds dense_resource constants (bytes outside the walk)"

/* The attribute names seen on the ops of one name, sorted as MLIR sorts an
 * op's attributes (by bytes). An op whose properties hold its inherent
 * attributes rebuilds its whole attribute dictionary on every
 * mlirOperationGetAttribute (two thirds of a walk's time); looking the known
 * names up one by one does not. The lookup is trusted only when it finds as
 * many attributes as the op has: otherwise every attribute is read by position
 * and the names learned. */
typedef struct { MlirIdentifier id; MlirStringRef s; } Name;
typedef struct {
  Name *v;
  size_t n, cap;
  int custom_call;  /* 0 not known yet, 1 stablehlo.custom_call, -1 another op */
  int elidable;  /* 0 not known yet, 1 stablehlo.constant, 2 stablehlo.convert, -1 another op */
} NameList;

/* The values table of the last walk starts the next one at its size (the
 * modules a process keys are alike): no rehashing on the way up. Read and
 * written with the GIL held, as all of a walk's own code runs. */
static size_t values_hint = 1 << 14;

#define RECENT 4096  /* the values last numbered or looked up, direct-mapped */
/* Definitions are inserted into the value table in batches of PENDING: each
 * insert lands on a slot no cache holds, and a batch lets the memory system
 * fetch its slots at once instead of one after another. */
#define PENDING 64

typedef struct {
  Out out;
  Table idents, types, attrs, values, blocks, opnames;
  Table constants;  /* a constant's result -> its value attribute (written where used) */
  Table same;       /* an identity convert's result -> its operand, resolved */
  const void *precision_name;  /* the identifier "precision_config", once seen */
  Table precisions;  /* a precision_config array (uniqued) -> 1 DEFAULT only, 0 not */
  Slot *recent;  /* RECENT slots before `values`: most uses follow their definition closely */
  Slot pending[PENDING];  /* definitions not in `values` yet (inserted PENDING at a time) */
  size_t npending;
  uint64_t pending_mask;  /* a bit per pending key's hash: most lookups skip the scan */
  int forward;  /* a value was used before its definition: definitions look themselves up */
  NameList *lists;
  size_t nlists, caplists;
  uint64_t next_value;
  PyObject *ignore;   /* frozenset of str: attributes dropped at depth <= 1 */
  PyObject *renames;  /* dict str -> str: private function renames */
  PyObject *kernel;   /* callable or NULL: a tpu_custom_call's backend_config -> 3 bytes or None */
  int error;  /* 1 out of memory, 2 nested too deeply, 3 a dense_resource, 4 a name not UTF-8 */
  int attr_depth;
  char *text;         /* printer scratch */
  size_t text_n, text_cap;
} Walk;

static void collect(MlirStringRef s, void *data) {
  Walk *w = data;
  if (w->text_n + s.length > w->text_cap) {
    size_t cap = w->text_cap ? w->text_cap : 256;
    while (cap < w->text_n + s.length) cap *= 2;
    char *p = realloc(w->text, cap);
    if (!p) { w->error = 1; return; }
    w->text = p;
    w->text_cap = cap;
  }
  memcpy(w->text + w->text_n, s.data, s.length);
  w->text_n += s.length;
}

/* Interning: 0 and the content on first sight, index + 1 after. Returns 1
 * when the caller must write the content. */
static int intern(Walk *w, Table *t, const void *k) {
  int64_t idx = table_get(t, k);
  if (idx >= 0) { put_varint(&w->out, (uint64_t)idx + 1); return 0; }
  if (table_put(t, k, t->n)) { w->error = 1; return 0; }
  put_varint(&w->out, 0);
  return 1;
}

/* Names must be UTF-8, as the reference (which reads them as str) needs:
 * a module with one that is not is refused by both walks alike. */
static int utf8_or_fail(Walk *w, MlirStringRef s) {
  PyObject *u = PyUnicode_DecodeUTF8(s.data, (Py_ssize_t)s.length, "strict");
  if (u) { Py_DECREF(u); return 1; }
  PyErr_Clear();
  w->error = 4;
  return 0;
}

static void ref_ident(Walk *w, MlirIdentifier id) {
  if (intern(w, &w->idents, id.ptr)) {
    MlirStringRef s = p_mlirIdentifierStr(id);
    if (utf8_or_fail(w, s)) put_str(&w->out, s.data, s.length);
  }
}

static void ref_type(Walk *w, MlirType t) {
  if (intern(w, &w->types, t.ptr)) {
    w->text_n = 0;
    p_mlirTypePrint(t, collect, w);
    put_str(&w->out, w->text, w->text_n);
  }
}

/* A renamed symbol, when `name` is a private function's old name. */
static int renamed(Walk *w, MlirStringRef name, const char **out, Py_ssize_t *n) {
  if (!w->renames) return 0;
  PyObject *key = PyUnicode_FromStringAndSize(name.data, (Py_ssize_t)name.length);
  if (!key) { PyErr_Clear(); w->error = 4; return 0; }  /* not UTF-8: refused */
  PyObject *v = PyDict_GetItemWithError(w->renames, key);
  Py_DECREF(key);
  if (!v) return 0;
  *out = PyUnicode_AsUTF8AndSize(v, n);
  return *out != NULL;
}

static int eligible_dense(MlirAttribute a, size_t *nbytes) {
  if (!p_mlirAttributeIsADenseIntElements(a) && !p_mlirAttributeIsADenseFPElements(a)) return 0;
  MlirType et = p_mlirShapedTypeGetElementType(p_mlirAttributeGetType(a));
  unsigned bits;
  if (p_mlirTypeIsAInteger(et)) {
    bits = p_mlirIntegerTypeGetWidth(et);
    if (bits != 8 && bits != 16 && bits != 32 && bits != 64) return 0;
  } else if (p_mlirTypeIsAF16(et)) {
    bits = 16;
  } else if (p_mlirTypeIsAF32(et)) {
    bits = 32;
  } else if (p_mlirTypeIsAF64(et)) {
    bits = 64;
  } else {
    return 0;
  }
  int64_t count = p_mlirElementsAttrGetNumElements(a);
  if (count < 0) return 0;
  /* A splat stores one element; over an empty shape it holds none (the
   * reference sees an empty array there too). */
  if (p_mlirDenseElementsAttrIsSplat(a) && count > 1) count = 1;
  *nbytes = (size_t)count * (bits / 8);
  return 1;
}

static void ref_attr(Walk *w, MlirAttribute a);

static void attr_content(Walk *w, MlirAttribute a) {
  Out *o = &w->out;
  size_t nbytes;
  if (p_mlirAttributeIsAFlatSymbolRef(a)) {
    MlirStringRef s = p_mlirFlatSymbolRefAttrGetValue(a);
    const char *r;
    Py_ssize_t rn;
    if (!utf8_or_fail(w, s)) return;
    put_byte(o, 'R');
    if (renamed(w, s, &r, &rn)) put_str(o, r, (size_t)rn);
    else put_str(o, s.data, s.length);
  } else if (p_mlirAttributeIsAArray(a)) {
    intptr_t n = p_mlirArrayAttrGetNumElements(a);
    put_byte(o, 'A');
    put_varint(o, (uint64_t)n);
    for (intptr_t i = 0; i < n && !o->failed && !w->error; i++) ref_attr(w, p_mlirArrayAttrGetElement(a, i));
  } else if (p_mlirAttributeIsADictionary(a)) {
    intptr_t n = p_mlirDictionaryAttrGetNumElements(a);
    put_byte(o, 'D');
    put_varint(o, (uint64_t)n);
    for (intptr_t i = 0; i < n && !o->failed && !w->error; i++) {
      MlirNamedAttribute na = p_mlirDictionaryAttrGetElement(a, i);
      ref_ident(w, na.name);
      ref_attr(w, na.attribute);
    }
  } else if (eligible_dense(a, &nbytes)) {
    put_byte(o, 'E');
    ref_type(w, p_mlirAttributeGetType(a));
    put_byte(o, p_mlirDenseElementsAttrIsSplat(a) ? 1 : 0);
    put_varint(o, nbytes);
    put(o, p_mlirDenseElementsAttrGetRawData(a), nbytes);
  } else {
    w->text_n = 0;
    p_mlirAttributePrint(a, collect, w);
    /* A resource's bytes live outside the attribute: its printed form names
     * the blob without its content. Such a module is refused (the caller keys
     * it another way), never keyed by the name alone. */
    if (w->text_n >= 15 && memcmp(w->text, "dense_resource<", 15) == 0) { w->error = 3; return; }
    put_byte(o, 'T');
    put_str(o, w->text, w->text_n);
  }
}

static void ref_attr(Walk *w, MlirAttribute a) {
  if (!intern(w, &w->attrs, a.ptr)) return;
  if (++w->attr_depth > MAX_DEPTH) w->error = 2;
  else attr_content(w, a);
  w->attr_depth--;
}

static int ignored(Walk *w, MlirIdentifier name) {
  if (!w->ignore || PySet_GET_SIZE(w->ignore) == 0) return 0;
  MlirStringRef s = p_mlirIdentifierStr(name);
  PyObject *key = PyUnicode_FromStringAndSize(s.data, (Py_ssize_t)s.length);
  if (!key) { PyErr_Clear(); return 0; }
  int r = PySet_Contains(w->ignore, key);
  Py_DECREF(key);
  return r == 1;
}

static int is_name(MlirIdentifier id, const char *want) {
  MlirStringRef s = p_mlirIdentifierStr(id);
  size_t n = strlen(want);
  return s.length == n && memcmp(s.data, want, n) == 0;
}

/* arg_attrs / res_attrs of the module and its functions, less the ignore list. */
static void filtered_arg_attrs(Walk *w, MlirAttribute a) {
  Out *o = &w->out;
  intptr_t n = p_mlirArrayAttrGetNumElements(a);
  put_byte(o, 'F');
  put_varint(o, (uint64_t)n);
  for (intptr_t i = 0; i < n; i++) {
    MlirAttribute d = p_mlirArrayAttrGetElement(a, i);
    if (!p_mlirAttributeIsADictionary(d)) {
      put_byte(o, 'r');
      ref_attr(w, d);
      continue;
    }
    intptr_t m = p_mlirDictionaryAttrGetNumElements(d), kept = 0;
    for (intptr_t k = 0; k < m; k++)
      kept += !ignored(w, p_mlirDictionaryAttrGetElement(d, k).name);
    put_byte(o, 'D');
    put_varint(o, (uint64_t)kept);
    for (intptr_t k = 0; k < m; k++) {
      MlirNamedAttribute na = p_mlirDictionaryAttrGetElement(d, k);
      if (ignored(w, na.name)) continue;
      ref_ident(w, na.name);
      ref_attr(w, na.attribute);
    }
  }
}

#define DEFAULT_PRECISION "#stablehlo<precision DEFAULT>"

/* A precision_config of DEFAULT precisions only: the default, left out. */
static int default_precision(Walk *w, MlirNamedAttribute na) {
  if (w->precision_name ? na.name.ptr != w->precision_name
                        : !is_name(na.name, "precision_config"))
    return 0;
  w->precision_name = na.name.ptr;
  int64_t known = table_get(&w->precisions, na.attribute.ptr);
  if (known >= 0) return (int)known;
  int verdict = p_mlirAttributeIsAArray(na.attribute);
  size_t want = strlen(DEFAULT_PRECISION);
  intptr_t n = verdict ? p_mlirArrayAttrGetNumElements(na.attribute) : 0;
  for (intptr_t i = 0; i < n && verdict; i++) {
    w->text_n = 0;
    p_mlirAttributePrint(p_mlirArrayAttrGetElement(na.attribute, i), collect, w);
    verdict = !w->error && w->text_n == want && memcmp(w->text, DEFAULT_PRECISION, want) == 0;
  }
  if (!w->error && table_put(&w->precisions, na.attribute.ptr, (uint64_t)verdict)) w->error = 1;
  return verdict;
}

/* What happens to attribute `na` of an op at `depth`: 0 dropped, 1 kept as is,
 * 2 a renamed sym_name, 3 filtered argument attributes. */
static int attr_rule(Walk *w, MlirNamedAttribute na, int depth) {
  if (default_precision(w, na)) return 0;
  if (depth > 1) return 1;
  if (depth == 0 && is_name(na.name, "sym_name")) return 0;
  if (ignored(w, na.name)) return 0;
  if (depth == 1 && is_name(na.name, "sym_name") && p_mlirAttributeIsAString(na.attribute)) {
    const char *r;
    Py_ssize_t rn;
    if (renamed(w, p_mlirStringAttrGetValue(na.attribute), &r, &rn)) return 2;
  }
  if (w->ignore && PySet_GET_SIZE(w->ignore) && p_mlirAttributeIsAArray(na.attribute) &&
      (is_name(na.name, "arg_attrs") || is_name(na.name, "res_attrs")))
    return 3;
  return 1;
}

static int flush_pending(Walk *w) {
  Table *t = &w->values;
  if (table_reserve(t, w->npending)) return -1;
  for (size_t i = 0; i < w->npending; i++)
    __builtin_prefetch(&t->slots[slot_of(w->pending[i].key, t->cap)], 1);
  for (size_t i = 0; i < w->npending; i++) table_insert(t, w->pending[i].key, w->pending[i].val);
  w->npending = 0;
  w->pending_mask = 0;
  return 0;
}

/* A value, where it is used (def 0) or defined (def 1): its number + 1, or 0
 * when first seen (it takes the next number). A use before the definition
 * (graph regions, blocks out of dominance order) and its definition then both
 * say which. Until a walk meets such a use, a definition is always new and
 * waits in `pending` for its batch. */
static void number_value(Walk *w, MlirValue v, int def) {
  uint64_t h = mix(v.ptr);
  Slot *r = &w->recent[h >> 52];
  if (r->key == v.ptr) { put_varint(&w->out, r->val + 2); return; }
  if (!def && (w->same.n || w->constants.n)) {  /* never in `recent` nor `values` */
    int64_t to = w->same.n ? table_get(&w->same, v.ptr) : -1;
    if (to >= 0) {
      MlirValue operand = {(const void *)to};
      number_value(w, operand, 0);
      return;
    }
    int64_t c = w->constants.n ? table_get(&w->constants, v.ptr) : -1;
    if (c >= 0) {
      MlirAttribute value = {(const void *)c};
      put_varint(&w->out, 1);
      ref_attr(w, value);
      return;
    }
  }
  if (def && !w->forward) {
    if (w->npending == PENDING && flush_pending(w)) { w->error = 1; return; }
    w->pending[w->npending].key = v.ptr;
    w->pending[w->npending++].val = w->next_value;
    w->pending_mask |= 1ull << (h >> 58);
    r->key = v.ptr;
    r->val = w->next_value++;
    put_varint(&w->out, 0);
    return;
  }
  int64_t idx = -1;
  if (w->pending_mask & (1ull << (h >> 58)))
    for (size_t i = w->npending; i-- > 0;)
      if (w->pending[i].key == v.ptr) { idx = (int64_t)w->pending[i].val; break; }
  if (idx < 0) idx = table_get(&w->values, v.ptr);
  if (idx >= 0) {
    r->key = v.ptr;
    r->val = (uint64_t)idx;
    put_varint(&w->out, (uint64_t)idx + 2);
    return;
  }
  if (!def && !w->forward) {  /* the first use before a definition: look definitions up from now */
    w->forward = 1;
    if (flush_pending(w)) { w->error = 1; return; }
  }
  if (table_put(&w->values, v.ptr, w->next_value)) { w->error = 1; return; }
  r->key = v.ptr;
  r->val = w->next_value++;
  put_varint(&w->out, 0);
}

/* The value table's slots for the operands of `op` that the recent cache
 * does not hold: fetched while the op before it is walked. */
static void prefetch_uses(Walk *w, MlirOperation op) {
  intptr_t n = p_mlirOperationGetNumOperands(op);
  for (intptr_t i = 0; i < n && i < 4; i++) {
    MlirValue v = p_mlirOperationGetOperand(op, i);
    uint64_t h = mix(v.ptr);
    if (w->recent[h >> 52].key != v.ptr)
      __builtin_prefetch(&w->values.slots[slot_of(v.ptr, w->values.cap)]);
  }
}

static int name_cmp(MlirStringRef a, MlirStringRef b) {
  int c = memcmp(a.data, b.data, a.length < b.length ? a.length : b.length);
  return c ? c : (a.length < b.length ? -1 : a.length > b.length);
}

static NameList *names_of(Walk *w, MlirIdentifier opname) {
  int64_t idx = table_get(&w->opnames, opname.ptr);
  if (idx >= 0) return &w->lists[idx];
  if (w->nlists == w->caplists) {
    size_t cap = w->caplists ? 2 * w->caplists : 64;
    NameList *p = realloc(w->lists, cap * sizeof *p);
    if (!p) return NULL;
    w->lists = p;
    w->caplists = cap;
  }
  if (table_put(&w->opnames, opname.ptr, w->nlists)) return NULL;
  NameList *l = &w->lists[w->nlists++];
  memset(l, 0, sizeof *l);
  return l;
}

static int learn(NameList *l, MlirIdentifier id) {
  MlirStringRef s = p_mlirIdentifierStr(id);
  size_t at = 0;
  while (at < l->n && name_cmp(l->v[at].s, s) < 0) at++;
  if (at < l->n && name_cmp(l->v[at].s, s) == 0) return 0;
  if (l->n == l->cap) {
    size_t cap = l->cap ? 2 * l->cap : 8;
    Name *p = realloc(l->v, cap * sizeof *p);
    if (!p) return -1;
    l->v = p;
    l->cap = cap;
  }
  memmove(l->v + at + 1, l->v + at, (l->n - at) * sizeof *l->v);
  l->v[at].id = id;
  l->v[at].s = s;
  l->n++;
  return 0;
}

/* The n attributes of `op` into out[], in MLIR's order. */
static int read_attrs(NameList *l, MlirOperation op, intptr_t n, MlirNamedAttribute *out) {
  intptr_t found = 0;
  if ((intptr_t)l->n >= n) {
    for (size_t k = 0; k < l->n && found < n; k++) {
      MlirAttribute a = p_mlirOperationGetAttributeByName(op, l->v[k].s);
      if (a.ptr) {
        out[found].name = l->v[k].id;
        out[found].attribute = a;
        found++;
      }
    }
  }
  if (found == n) return 0;
  for (intptr_t i = 0; i < n; i++) {
    out[i] = p_mlirOperationGetAttribute(op, i);
    if (learn(l, out[i].name)) return -1;
  }
  return 0;
}


static MlirStringRef cstr(const char *s) {
  MlirStringRef r = {s, strlen(s)};
  return r;
}

/* A Pallas/Mosaic TPU kernel call: its backend_config carries the kernel's
 * MLIR bytecode, locations included (worker/keylib/mosaic.py). */
static int is_tpu_kernel_call(Walk *w, MlirOperation op, MlirIdentifier opname, NameList *l) {
  if (!w->kernel) return 0;
  if (!l->custom_call) l->custom_call = is_name(opname, "stablehlo.custom_call") ? 1 : -1;
  if (l->custom_call < 0) return 0;
  MlirAttribute t = p_mlirOperationGetAttributeByName(op, cstr("call_target_name"));
  if (!t.ptr || !p_mlirAttributeIsAString(t)) return 0;
  MlirStringRef v = p_mlirStringAttrGetValue(t);
  return v.length == 15 && memcmp(v.data, "tpu_custom_call", 15) == 0;
}

/* 'K' str(before) str(kernel digest) str(after), as the hook splits the
 * config; 0 when the hook keeps it whole (None), -1 with an exception set. */
static int kernel_value(Walk *w, MlirAttribute a) {
  MlirStringRef s = p_mlirStringAttrGetValue(a);
  PyObject *arg = PyBytes_FromStringAndSize(s.data, (Py_ssize_t)s.length);
  PyObject *r = arg ? PyObject_CallOneArg(w->kernel, arg) : NULL;
  Py_XDECREF(arg);
  if (!r) { w->out.failed = 1; return -1; }
  if (r == Py_None) { Py_DECREF(r); return 0; }
  if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 3 || !PyBytes_Check(PyTuple_GET_ITEM(r, 0)) ||
      !PyBytes_Check(PyTuple_GET_ITEM(r, 1)) || !PyBytes_Check(PyTuple_GET_ITEM(r, 2))) {
    Py_DECREF(r);
    PyErr_SetString(PyExc_ValueError, "the kernel hook must return None or 3 bytes");
    w->out.failed = 1;
    return -1;
  }
  put_byte(&w->out, 'K');
  for (int i = 0; i < 3; i++) {
    PyObject *b = PyTuple_GET_ITEM(r, i);
    put_str(&w->out, PyBytes_AS_STRING(b), (size_t)PyBytes_GET_SIZE(b));
  }
  Py_DECREF(r);
  return 1;
}

/* A constant, or a convert to its operand's type (kind 1, 2): nothing is
 * written here; its uses write the constant's value, or the operand. Not a
 * result a use before its definition has numbered already. */
static int elided(Walk *w, MlirOperation op, int kind) {
  if (p_mlirOperationGetNumResults(op) != 1 || p_mlirOperationGetNumRegions(op)) return 0;
  MlirValue result = p_mlirOperationGetResult(op, 0);
  if (w->forward && table_get(&w->values, result.ptr) >= 0) return 0;
  if (kind == 1) {
    if (p_mlirOperationGetNumOperands(op) || p_mlirOperationGetNumAttributes(op) != 1) return 0;
    MlirAttribute value = p_mlirOperationGetAttributeByName(op, cstr("value"));
    if (!value.ptr) return 0;
    if (table_put(&w->constants, result.ptr, (uint64_t)(uintptr_t)value.ptr)) w->error = 1;
    return 1;
  }
  if (p_mlirOperationGetNumOperands(op) != 1 || p_mlirOperationGetNumAttributes(op)) return 0;
  MlirValue operand = p_mlirOperationGetOperand(op, 0);
  if (p_mlirValueGetType(operand).ptr != p_mlirValueGetType(result).ptr) return 0;
  int64_t to = w->same.n ? table_get(&w->same, operand.ptr) : -1;
  if (table_put(&w->same, result.ptr, to >= 0 ? (uint64_t)to : (uint64_t)(uintptr_t)operand.ptr))
    w->error = 1;
  return 1;
}

static void walk_op(Walk *w, MlirOperation op, int depth) {
  Out *o = &w->out;
  if (o->failed || w->error) return;
  if (depth > MAX_DEPTH) { w->error = 2; return; }
  MlirIdentifier opname = p_mlirOperationGetName(op);
  NameList *l = names_of(w, opname);
  if (!l) { w->error = 1; return; }
  if (!l->elidable)
    l->elidable = is_name(opname, "stablehlo.constant") ? 1
                  : is_name(opname, "stablehlo.convert") ? 2 : -1;
  if (l->elidable > 0 && elided(w, op, l->elidable)) return;
  put_byte(o, 'O');
  ref_ident(w, opname);
  intptr_t n = p_mlirOperationGetNumOperands(op);
  put_varint(o, (uint64_t)n);
  for (intptr_t i = 0; i < n; i++) number_value(w, p_mlirOperationGetOperand(op, i), 0);
  n = p_mlirOperationGetNumResults(op);
  put_varint(o, (uint64_t)n);
  for (intptr_t i = 0; i < n; i++) {
    MlirValue v = p_mlirOperationGetResult(op, i);
    number_value(w, v, 1);
    ref_type(w, p_mlirValueGetType(v));
  }
  n = p_mlirOperationGetNumAttributes(op);
  MlirNamedAttribute few[16], *named = n <= 16 ? few : malloc((size_t)n * sizeof *named);
  if (!named || read_attrs(l, op, n, named)) {
    if (named != few) free(named);
    w->error = 1;
    return;
  }
  int kernel_call = is_tpu_kernel_call(w, op, opname, l);
  intptr_t kept = 0;
  for (intptr_t i = 0; i < n; i++) kept += attr_rule(w, named[i], depth) != 0;
  put_varint(o, (uint64_t)kept);
  for (intptr_t i = 0; i < n; i++) {
    MlirNamedAttribute na = named[i];
    int rule = attr_rule(w, na, depth);
    if (rule == 0) continue;
    ref_ident(w, na.name);
    if (rule == 1) {
      int k = 0;
      if (kernel_call && is_name(na.name, "backend_config") && p_mlirAttributeIsAString(na.attribute))
        k = kernel_value(w, na.attribute);
      if (k < 0) break;
      if (k == 0) {
        put_byte(o, 'r');
        ref_attr(w, na.attribute);
      }
    } else if (rule == 2) {
      const char *r;
      Py_ssize_t rn;
      renamed(w, p_mlirStringAttrGetValue(na.attribute), &r, &rn);
      put_byte(o, 'S');
      put_str(o, r, (size_t)rn);
    } else {
      filtered_arg_attrs(w, na.attribute);
    }
  }
  if (named != few) free(named);
  n = p_mlirOperationGetNumSuccessors(op);
  put_varint(o, (uint64_t)n);
  for (intptr_t i = 0; i < n; i++) {
    int64_t b = table_get(&w->blocks, p_mlirOperationGetSuccessor(op, i).ptr);
    put_varint(o, b < 0 ? 0 : (uint64_t)b + 1);
  }
  n = p_mlirOperationGetNumRegions(op);
  put_varint(o, (uint64_t)n);
  for (intptr_t r = 0; r < n; r++) {
    MlirRegion region = p_mlirOperationGetRegion(op, r);
    uint64_t nblocks = 0;
    for (MlirBlock b = p_mlirRegionGetFirstBlock(region); b.ptr; b = p_mlirBlockGetNextInRegion(b)) {
      if (table_put(&w->blocks, b.ptr, w->blocks.n)) { w->error = 1; return; }
      nblocks++;
    }
    put_varint(o, nblocks);
    for (MlirBlock b = p_mlirRegionGetFirstBlock(region); b.ptr; b = p_mlirBlockGetNextInRegion(b)) {
      intptr_t na = p_mlirBlockGetNumArguments(b);
      put_varint(o, (uint64_t)na);
      for (intptr_t i = 0; i < na; i++) {
        MlirValue v = p_mlirBlockGetArgument(b, i);
        number_value(w, v, 1);
        ref_type(w, p_mlirValueGetType(v));
      }
      for (MlirOperation c = p_mlirBlockGetFirstOperation(b), next; c.ptr; c = next) {
        next = p_mlirOperationGetNextInBlock(c);
        if (next.ptr) prefetch_uses(w, next);
        walk_op(w, c, depth + 1);
      }
      put_byte(o, 'Z');  /* the block's end: every op starts with 'O' */
    }
  }
}


/* A string attribute's value as str, or NULL with ValueError (not a string,
 * or not UTF-8), as the reference's ir.StringAttr(...).value would fail. */
static PyObject *string_value(MlirAttribute a, const char *what) {
  if (!p_mlirAttributeIsAString(a)) {
    PyErr_Format(PyExc_ValueError, "%s is not a string attribute", what);
    return NULL;
  }
  MlirStringRef s = p_mlirStringAttrGetValue(a);
  return PyUnicode_DecodeUTF8(s.data, (Py_ssize_t)s.length, "strict");
}

/* mlircanon.private_renames, in C: the module body's private functions
 * renamed f0, f1, ... in order of appearance; {} when a new name is a
 * public function's name. */
static PyObject *private_renames(MlirOperation module) {
  MlirBlock body = p_mlirRegionGetFirstBlock(p_mlirOperationGetRegion(module, 0));
  if (!body.ptr) {
    PyErr_SetString(PyExc_ValueError, "the module has no body");
    return NULL;
  }
  PyObject *mapping = PyDict_New(), *public = PySet_New(NULL);
  if (!mapping || !public) goto fail;
  for (MlirOperation op = p_mlirBlockGetFirstOperation(body); op.ptr;
       op = p_mlirOperationGetNextInBlock(op)) {
    MlirAttribute a = p_mlirOperationGetAttributeByName(op, cstr("sym_name"));
    if (!a.ptr) continue;
    PyObject *name = string_value(a, "sym_name");
    if (!name) goto fail;
    MlirAttribute vis = p_mlirOperationGetAttributeByName(op, cstr("sym_visibility"));
    int private = 0;
    if (vis.ptr) {
      PyObject *v = string_value(vis, "sym_visibility");
      if (!v) { Py_DECREF(name); goto fail; }
      private = PyUnicode_CompareWithASCIIString(v, "private") == 0;
      Py_DECREF(v);
    }
    int rc;
    if (private) {
      PyObject *fresh = PyUnicode_FromFormat("f%zd", PyDict_GET_SIZE(mapping));
      rc = fresh ? PyDict_SetItem(mapping, name, fresh) : -1;
      Py_XDECREF(fresh);
    } else {
      rc = PySet_Add(public, name);
    }
    Py_DECREF(name);
    if (rc) goto fail;
  }
  PyObject *k, *v;
  Py_ssize_t pos = 0;
  while (PyDict_Next(mapping, &pos, &k, &v))  /* public -= mapping */
    if (PySet_Discard(public, k) < 0) goto fail;
  pos = 0;
  while (PyDict_Next(mapping, &pos, &k, &v)) {
    int clash = PySet_Contains(public, v);
    if (clash < 0) goto fail;
    if (clash) {
      PyDict_Clear(mapping);
      break;
    }
  }
  Py_DECREF(public);
  return mapping;
fail:
  Py_XDECREF(mapping);
  Py_XDECREF(public);
  return NULL;
}

/* canonical_stream(capsule, hasher, ignore: frozenset[str], renames: dict[str, str] | None
 *                  [, kernel: callable | None]);
 * renames None: the private function renames of the module, found here. */
static PyObject *canonical_stream(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *capsule, *hasher, *ignore, *renames, *kernel = Py_None;
  if (!PyArg_ParseTuple(args, "OOO!O|O", &capsule, &hasher, &PyFrozenSet_Type, &ignore, &renames,
                        &kernel))
    return NULL;
  if (kernel != Py_None && !PyCallable_Check(kernel)) {
    PyErr_SetString(PyExc_TypeError, "kernel must be callable or None");
    return NULL;
  }
  if (renames != Py_None && !PyDict_Check(renames)) {
    PyErr_SetString(PyExc_TypeError, "renames must be a dict or None");
    return NULL;
  }
  if (!bound) {
    PyErr_SetString(PyExc_RuntimeError, "MLIR C API not bound: call bind() first");
    return NULL;
  }
  if (!PyCapsule_CheckExact(capsule)) {
    PyErr_SetString(PyExc_TypeError, "expected an MLIR Module capsule (module._CAPIPtr)");
    return NULL;
  }
  const char *cname = PyCapsule_GetName(capsule);
  if (!cname || !strstr(cname, "ir.Module._CAPIPtr")) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "expected an MLIR Module capsule");
    return NULL;
  }
  MlirModule m = {PyCapsule_GetPointer(capsule, cname)};
  if (!m.ptr) return NULL;
  MlirOperation top = p_mlirModuleGetOperation(m);
  PyObject *found = NULL;
  if (renames == Py_None) {
    if (!(found = private_renames(top))) return NULL;
    renames = found;
  }
  Walk w;
  memset(&w, 0, sizeof w);
  w.out.cap = CHUNK;
  w.out.d = malloc(CHUNK);
  w.out.hasher = hasher;
  w.ignore = ignore;
  w.renames = PyDict_GET_SIZE(renames) ? renames : NULL;
  w.kernel = kernel == Py_None ? NULL : kernel;
  w.recent = calloc(RECENT, sizeof(Slot));
  if (!w.out.d || !w.recent || table_init(&w.idents, 256) || table_init(&w.types, 1024) ||
      table_init(&w.attrs, 4096) || table_init(&w.values, values_hint) || table_init(&w.blocks, 256) ||
      table_init(&w.opnames, 256) || table_init(&w.constants, 1024) || table_init(&w.same, 256) ||
      table_init(&w.precisions, 16)) {
    w.error = 1;
  } else {
    walk_op(&w, top, 0);
    if (!w.out.failed && !w.error) out_flush(&w.out);
  }
  free(w.out.d);
  free(w.recent);
  free(w.text);
  table_free(&w.idents);
  table_free(&w.types);
  table_free(&w.attrs);
  if (!w.error && !flush_pending(&w) && w.values.cap <= (1u << 22)) values_hint = w.values.cap;
  table_free(&w.values);
  table_free(&w.blocks);
  table_free(&w.opnames);
  table_free(&w.constants);
  table_free(&w.same);
  table_free(&w.precisions);
  for (size_t i = 0; i < w.nlists; i++) free(w.lists[i].v);
  free(w.lists);
  Py_XDECREF(found);
  if (w.out.failed) return NULL;
  if (w.error == 2) {
    PyErr_SetString(PyExc_ValueError, "operations or attributes nested too deeply");
    return NULL;
  }
  if (w.error == 3) {
    PyErr_SetString(PyExc_ValueError, RESOURCE_REFUSED);
    return NULL;
  }
  if (w.error == 4) {
    PyErr_SetString(PyExc_ValueError, "a name in the module is not UTF-8");
    return NULL;
  }
  if (w.error) return PyErr_NoMemory();
  Py_RETURN_NONE;
}

static PyObject *names(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  PyObject *out = PyTuple_New(NAPI);
  if (!out) return NULL;
  for (size_t i = 0; i < NAPI; i++) {
    PyObject *n = PyUnicode_FromString(api_names[i]);
    if (!n) { Py_DECREF(out); return NULL; }
    PyTuple_SET_ITEM(out, i, n);
  }
  return out;
}

static PyMethodDef methods[] = {
    {"api_names", names, METH_NOARGS, "The C API functions this module binds, in order."},
    {"symbols", symbols, METH_VARARGS, "Where the C API's symbols are in an ELF file."},
    {"bind", bind, METH_VARARGS, "bind(path, locations): use the C API of a loaded library file."},
    {"canonical_stream", canonical_stream, METH_VARARGS,
     "canonical_stream(module_capsule, hasher, ignore, renames): feed the canonical stream to hasher.update."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_mlircanon", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__mlircanon(void) { return PyModule_Create(&module); }
