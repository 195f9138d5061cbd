/* compilecast's PJRT interposer: a PJRT plugin that wraps another.
 *
 * Loaded by a framework as its PJRT plugin (GetPjrtApi), it loads the real
 * plugin named by COMPILECAST_PJRT_PLUGIN and hands the framework the real
 * plugin's function table, with PJRT_Client_Compile replaced. A compile asks
 * the host's worker (COMPILECAST_WORKER's unix socket + ".pjrt",
 * worker/pjrtdoor/pjrtgate.py) with the program, its serialized compile options and
 * what else the executable depends on (the plugin's build and attributes,
 * the devices, the environment the plugin reads); the worker keys it and
 * answers, after any number of WAITING frames (heartbeats while it waits):
 *   HIT      the serialized executable and its sha256: loaded with
 *            PJRT_Executable_DeserializeAndLoad once the bytes hash to it;
 *   COMPILE  this process holds the compile lease: the real compile (with
 *            the compile options the answer carries, if any), then
 *            PJRT_Executable_Serialize, sent to the worker to publish;
 *   LOCAL    compile with the real plugin and share nothing.
 * A worker silent for COMPILECAST_PJRT_SILENCE_S (no heartbeat) means a real
 * compile now. Each exchange has one deadline that every send and receive
 * honours, below the silence bound too: the question and its answer, by
 * COMPILECAST_PJRT_TIMEOUT_S or the share-binary timeout
 * (COMPILECAST_SHARE_BINARY_BETWEEN_HOSTS_TIMEOUT_MS, after which the worker
 * ends any wait) plus the silence bound, whichever is first; the publish, by
 * COMPILECAST_PJRT_PUBLISH_S plus the executable's size at 4 MiB/s, and so is
 * a reply's payload once its size is known. A heartbeat (WAITING, its payload
 * the seconds s as text) says the answer comes within s seconds: the deadline
 * comes in to that (plus the silence bound), never goes out, however many
 * heartbeats follow. The
 * compile options a COMPILE hands back that the plugin refuses are dropped:
 * the compile is made again with the framework's own.
 * Anything else (no worker, a refused load, a protocol error, an unknown
 * PJRT C API major version) compiles with the real plugin; the reason goes to
 * stderr once per kind. The framework's compile never fails because of
 * compilecast: errors returned are the real plugin's own.
 *
 * The PJRT C API declarations below are our own, of what this file uses, in
 * the layout of the API's major version 0 (openxla/xla,
 * xla/pjrt/c/pjrt_c_api.h, Apache-2.0). Within a major version, argument
 * structs and PJRT_Api only ever gain fields at their ends, so these offsets
 * hold for every 0.x plugin; a plugin of another major version is passed
 * through untouched.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <limits.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define CC_PJRT_MAJOR 0

/* ---- PJRT C API, major version 0: what this file uses -------------------- */

typedef struct PJRT_Error PJRT_Error;
typedef struct PJRT_Client PJRT_Client;
typedef struct PJRT_Device PJRT_Device;
typedef struct PJRT_DeviceDescription PJRT_DeviceDescription;
typedef struct PJRT_Executable PJRT_Executable;
typedef struct PJRT_LoadedExecutable PJRT_LoadedExecutable;
typedef struct PJRT_SerializedExecutable PJRT_SerializedExecutable;
typedef void *cc_fn; /* a slot of the function table */

typedef struct {
  size_t struct_size;
  void *extension_start;
  int major_version;
  int minor_version;
} cc_Api_Version;

typedef struct {
  size_t struct_size;
  void *extension_start;
  cc_Api_Version pjrt_api_version;
  cc_fn fns[]; /* in the order of PJRT_Api */
} cc_Api;

/* Slots of PJRT_Api's function table (index after pjrt_api_version). */
enum {
  SLOT_Error_Destroy = 0,
  SLOT_Error_Message = 1,
  SLOT_Plugin_Attributes = 4,
  SLOT_Client_PlatformName = 12,
  SLOT_Client_ProcessIndex = 13,
  SLOT_Client_PlatformVersion = 14,
  SLOT_Client_Devices = 15,
  SLOT_Client_Compile = 20,
  SLOT_DeviceDescription_Id = 23,
  SLOT_DeviceDescription_ProcessIndex = 24,
  SLOT_DeviceDescription_Attributes = 25,
  SLOT_DeviceDescription_Kind = 26,
  SLOT_Device_GetDescription = 29,
  SLOT_Executable_Destroy = 40,
  SLOT_Executable_Serialize = 49,
  SLOT_LoadedExecutable_Destroy = 50,
  SLOT_LoadedExecutable_GetExecutable = 51,
  SLOT_Executable_DeserializeAndLoad = 56,
  SLOT_COUNT_NEEDED = 57
};

#define HEAD size_t struct_size; void *extension_start
typedef struct { HEAD; PJRT_Error *error; } Error_Destroy_Args;
typedef struct { HEAD; const PJRT_Error *error; const char *message; size_t message_size; } Error_Message_Args;
typedef struct { HEAD; PJRT_Client *client; const char *out; size_t out_size; } Client_String_Args;
typedef struct { HEAD; PJRT_Client *client; int process_index; } Client_ProcessIndex_Args;
typedef struct { HEAD; PJRT_Client *client; PJRT_Device *const *devices; size_t num_devices; } Client_Devices_Args;
typedef struct { HEAD; PJRT_Device *device; PJRT_DeviceDescription *description; } Device_GetDescription_Args;
typedef struct { HEAD; PJRT_DeviceDescription *description; int value; } DeviceDescription_Int_Args;
typedef struct {
  HEAD;
  const char *name;
  size_t name_size;
  int type; /* 0 string, 1 int64, 2 int64 list, 3 float, 4 bool */
  union {
    const char *s;
    int64_t i;
    const int64_t *list;
    float f;
    _Bool b;
  } value;
  size_t value_size;
} NamedValue;
typedef struct { HEAD; const NamedValue *attributes; size_t num_attributes; } Plugin_Attributes_Args;
typedef struct {
  HEAD;
  PJRT_DeviceDescription *description;
  size_t num_attributes;
  const NamedValue *attributes;
} DeviceDescription_Attributes_Args;
typedef struct {
  HEAD;
  PJRT_DeviceDescription *description;
  const char *kind;
  size_t kind_size;
} DeviceDescription_Kind_Args;
typedef struct { HEAD; char *code; size_t code_size; const char *format; size_t format_size; } Program;
typedef struct {
  HEAD;
  PJRT_Client *client;
  const Program *program;
  const char *compile_options;
  size_t compile_options_size;
  PJRT_LoadedExecutable *executable; /* out */
} Client_Compile_Args;
typedef struct { HEAD; PJRT_LoadedExecutable *loaded; PJRT_Executable *executable; } GetExecutable_Args;
typedef struct { HEAD; PJRT_Executable *executable; } Executable_Destroy_Args;
typedef struct { HEAD; PJRT_LoadedExecutable *executable; } LoadedExecutable_Destroy_Args;
typedef struct {
  HEAD;
  const PJRT_Executable *executable;
  const char *bytes;
  size_t bytes_size;
  PJRT_SerializedExecutable *serialized;
  void (*deleter)(PJRT_SerializedExecutable *);
} Executable_Serialize_Args;
typedef struct {
  HEAD;
  PJRT_Client *client;
  const char *serialized;
  size_t serialized_size;
  PJRT_LoadedExecutable *loaded; /* out */
  const char *overridden_compile_options; /* none: the executable's own */
  size_t overridden_compile_options_size;
} DeserializeAndLoad_Args;
#undef HEAD

typedef PJRT_Error *(*api_call)(void *args);
typedef void (*api_void_call)(void *args);

/* ---- state ---------------------------------------------------------------- */

static const cc_Api *real_api;   /* the wrapped plugin's table */
static cc_Api *our_api;          /* its copy, with our compile */
static pthread_once_t loaded = PTHREAD_ONCE_INIT;
static unsigned said;            /* which reasons were printed already */

static void say_once(unsigned kind, const char *fmt, ...) {
  if (__atomic_fetch_or(&said, kind, __ATOMIC_RELAXED) & kind) return;
  va_list ap;
  va_start(ap, fmt);
  fputs("compilecast-pjrt: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
}

static void note(const char *fmt, ...) { /* every time, when asked for */
  static int verbose = -1;
  if (verbose < 0) {
    const char *v = getenv("COMPILECAST_PJRT_LOG");
    verbose = v && *v && strcmp(v, "0") != 0;
  }
  if (!verbose) return;
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "compilecast-pjrt[%d]: ", (int)getpid());
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
}

static api_call slot(int index) { return (api_call)real_api->fns[index]; }

static void drop_error(PJRT_Error *error) {
  if (!error) return;
  Error_Destroy_Args a = {sizeof a, NULL, error};
  ((api_void_call)real_api->fns[SLOT_Error_Destroy])(&a);
}

static const char *error_text(PJRT_Error *error, char *buf, size_t len) {
  Error_Message_Args a = {sizeof a, NULL, error, NULL, 0};
  ((api_void_call)real_api->fns[SLOT_Error_Message])(&a);
  snprintf(buf, len, "%.*s", (int)(a.message_size < 300 ? a.message_size : 300),
           a.message ? a.message : "");
  return buf;
}

/* ---- a growing text buffer (what the worker is told) ---------------------- */

typedef struct {
  char *data;
  size_t len, cap;
  int failed;
} text;

static void put(text *t, const void *p, size_t n) {
  if (t->failed) return;
  if (t->len + n + 1 > t->cap) {
    size_t cap = t->cap ? t->cap : 1024;
    while (cap < t->len + n + 1) cap *= 2;
    char *grown = cap <= ((size_t)64 << 20) ? realloc(t->data, cap) : NULL;
    if (!grown) {
      t->failed = 1;
      return;
    }
    t->data = grown;
    t->cap = cap;
  }
  memcpy(t->data + t->len, p, n);
  t->len += n;
  t->data[t->len] = 0;
}

static void putf(text *t, const char *fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (n > 0) put(t, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
}

/* ---- sha256 (FIPS 180-4), to check what the worker hands over -------------- */

typedef struct {
  uint32_t h[8];
  uint64_t n;
  unsigned char block[64];
} sha256_ctx;

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

#define ROR(x, k) (((x) >> (k)) | ((x) << (32 - (k))))

static void sha256_block(sha256_ctx *c, const unsigned char *p) {
  uint32_t w[64], a, b, d, e, f, g, h, cc;
  for (int i = 0; i < 16; i++)
    w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 |
           p[4 * i + 3];
  for (int i = 16; i < 64; i++) {
    uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
    uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  a = c->h[0], b = c->h[1], cc = c->h[2], d = c->h[3];
  e = c->h[4], f = c->h[5], g = c->h[6], h = c->h[7];
  for (int i = 0; i < 64; i++) {
    uint32_t t1 = h + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) + K256[i] + w[i];
    uint32_t t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & cc) ^ (b & cc));
    h = g, g = f, f = e, e = d + t1, d = cc, cc = b, b = a, a = t1 + t2;
  }
  c->h[0] += a, c->h[1] += b, c->h[2] += cc, c->h[3] += d;
  c->h[4] += e, c->h[5] += f, c->h[6] += g, c->h[7] += h;
}

static void sha256_hex(const void *data, size_t n, char out[65]) {
  sha256_ctx c = {{0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c,
                   0x1f83d9ab, 0x5be0cd19}, 0, {0}};
  const unsigned char *p = data;
  size_t whole = n - n % 64;
  for (size_t i = 0; i < whole; i += 64) sha256_block(&c, p + i);
  unsigned char last[128] = {0};
  size_t rest = n - whole;
  memcpy(last, p + whole, rest);
  last[rest] = 0x80;
  size_t blocks = rest + 9 > 64 ? 2 : 1;
  uint64_t bits = (uint64_t)n * 8;
  for (int i = 0; i < 8; i++) last[blocks * 64 - 1 - i] = (unsigned char)(bits >> (8 * i));
  for (size_t i = 0; i < blocks; i++) sha256_block(&c, last + 64 * i);
  for (int i = 0; i < 8; i++) snprintf(out + 8 * i, 9, "%08x", c.h[i]);
}

/* ---- the worker's socket -------------------------------------------------- */

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}

static double setting_s(const char *name, double fallback) {
  const char *v = getenv(name);
  double d = v && *v ? strtod(v, NULL) : 0;
  return d > 0 ? d : fallback;
}

/* The exchange with the worker ends by this time (CLOCK_MONOTONIC). */
static __thread double deadline; /* per compiling thread */
static double silence_s = 10.0;  /* COMPILECAST_PJRT_SILENCE_S */

/* The next send or receive waits at most the silence bound, and never past
   the deadline; -1 once the deadline has passed. */
static int pace(int fd) {
  double left = deadline - now();
  if (left <= 0) return -1;
  double w = left < silence_s ? left : silence_s;
  struct timeval tv = {(time_t)w, (suseconds_t)((w - (time_t)w) * 1e6)};
  if (!tv.tv_sec && tv.tv_usec < 1000) tv.tv_usec = 1000; /* (zero would mean: forever) */
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  return 0;
}

static int write_all(int fd, const void *data, size_t n) {
  const char *p = data;
  while (n) {
    if (pace(fd)) return -1;
    ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    p += k;
    n -= (size_t)k;
  }
  return 0;
}

/* Each recv waits at most the silence bound (SO_RCVTIMEO): a worker that says
   nothing for that long, not even a heartbeat, is given up; and never past
   the deadline, however the bytes trickle. */
static int read_all(int fd, void *data, size_t n) {
  char *p = data;
  while (n) {
    if (pace(fd)) return -1;
    ssize_t k = recv(fd, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    p += k;
    n -= (size_t)k;
  }
  return 0;
}

/* How long `size` bytes over the worker's socket may take: COMPILECAST_PJRT_PUBLISH_S
   plus the size at 4 MiB/s (a publish, a HIT's executable). */
static double transfer_s(uint64_t size) {
  return setting_s("COMPILECAST_PJRT_PUBLISH_S", 60.0) + (double)size / (4 << 20);
}

/* A frame: "CCP2", u32 header size, header, u8 count, then count times a u64
   size and its bytes. */
static int send_frame(int fd, const char *header, int count, const void *const *blobs,
                      const uint64_t *sizes) {
  uint32_t nh = (uint32_t)strlen(header);
  unsigned char c = (unsigned char)count;
  if (write_all(fd, "CCP2", 4) || write_all(fd, &nh, 4) || write_all(fd, header, nh) ||
      write_all(fd, &c, 1))
    return -1;
  for (int i = 0; i < count; i++)
    if (write_all(fd, &sizes[i], 8) || (sizes[i] && write_all(fd, blobs[i], sizes[i]))) return -1;
  return 0;
}

static int send_word(int fd, const char *header) { return send_frame(fd, header, 0, NULL, NULL); }

/* A reply: "CCP2", u32 header size, header ("WORD rest"), u8 count (0 or 1),
   the payload. WAITING frames (heartbeats) are read past. */
typedef struct {
  char header[1024];
  char *payload;
  uint64_t payload_size;
} reply;

static int read_one(int fd, reply *r) {
  char magic[4];
  uint32_t nh;
  unsigned char count;
  memset(r, 0, sizeof *r);
  if (read_all(fd, magic, 4) || memcmp(magic, "CCP2", 4) || read_all(fd, &nh, 4)) return -1;
  if (nh >= sizeof r->header) return -1;
  if (read_all(fd, r->header, nh) || read_all(fd, &count, 1) || count > 1) return -1;
  if (!count) return 0;
  if (read_all(fd, &r->payload_size, 8)) return -1;
  if (r->payload_size > ((uint64_t)1 << 40)) return -1;
  /* The payload is bounded by what a local socket needs for its bytes
     (however they trickle), as a publish is. */
  double bytes_by = now() + transfer_s(r->payload_size);
  if (bytes_by < deadline) deadline = bytes_by;
  if (r->payload_size) {
    r->payload = malloc(r->payload_size);
    if (!r->payload) return -1;
    if (read_all(fd, r->payload, r->payload_size)) {
      free(r->payload);
      r->payload = NULL;
      return -1;
    }
  }
  return 0;
}

/* A heartbeat ("WAITING", its payload the seconds "s" as text) says the
   answer comes within s seconds: the deadline is brought in to that (and the
   silence bound), never pushed out. (A heartbeat without one says nothing.) */
static int read_reply(int fd, reply *r) {
  for (;;) {
    if (read_one(fd, r)) return -1;
    if (strcmp(r->header, "WAITING") != 0) return 0;
    if (r->payload && r->payload_size > 0 && r->payload_size < 32) {
      char text[32];
      memcpy(text, r->payload, r->payload_size);
      text[r->payload_size] = 0;
      char *end = NULL;
      double within = strtod(text, &end);
      if (end != text && within >= 0 && now() + within + silence_s < deadline)
        deadline = now() + within + silence_s;
    }
    free(r->payload);
  }
}

static int connect_worker(void) {
  const char *target = getenv("COMPILECAST_WORKER");
  char path[108];
  if (target && strncmp(target, "unix://", 7) == 0) {
    snprintf(path, sizeof path, "%s.pjrt", target + 7);
  } else if (target && *target) {
    say_once(1, "COMPILECAST_WORKER=%s is not a unix socket: compiling without compilecast",
             target);
    return -1;
  } else {
    const char *home = getenv("COMPILECAST_HOME");
    char dir[80];
    if (home && *home) snprintf(dir, sizeof dir, "%s", home);
    else snprintf(dir, sizeof dir, "%s/.cache/compilecast", getenv("HOME") ? getenv("HOME") : "");
    snprintf(path, sizeof path, "%s/worker.sock.pjrt", dir);
  }
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  struct sockaddr_un addr = {0};
  addr.sun_family = AF_UNIX;
  snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path);
  if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
    say_once(2, "worker socket %s: %s: compiling without compilecast", path, strerror(errno));
    close(fd);
    return -1;
  }
  /* The worker sends a heartbeat every couple of seconds while it decides or
     waits; silence this long means it stopped answering (pace). */
  silence_s = setting_s("COMPILECAST_PJRT_SILENCE_S", 10.0);
  return fd;
}

/* How long a compile's question and answer may take: COMPILECAST_PJRT_TIMEOUT_S,
   or the share-binary timeout plus the silence bound when that is sooner (the
   worker ends a wait at the share-binary timeout). */
static double exchange_s(void) {
  double t = setting_s("COMPILECAST_PJRT_TIMEOUT_S", 1500.0);
  double share = setting_s("COMPILECAST_SHARE_BINARY_BETWEEN_HOSTS_TIMEOUT_MS", 0) / 1000.0;
  if (share > 0 && share + silence_s < t) t = share + silence_s;
  return t;
}

/* ---- what the worker is told of the compile ------------------------------- */

static void client_string(int index, PJRT_Client *client, char *out, size_t len) {
  Client_String_Args a = {sizeof a, NULL, client, NULL, 0};
  PJRT_Error *e = slot(index)(&a);
  if (e) {
    drop_error(e);
    snprintf(out, len, "?");
    return;
  }
  size_t n = a.out_size < len - 1 ? a.out_size : len - 1;
  size_t j = 0;
  for (size_t i = 0; i < n && j < len - 1; i++) /* plain characters only: it goes in a header */
    if (a.out[i] >= 32 && a.out[i] < 127 && a.out[i] != '"' && a.out[i] != '\\') out[j++] = a.out[i];
  out[j] = 0;
}

/* Named values, one "<prefix>name=value" line each (lists comma-separated). */
static void put_named(text *t, const char *prefix, const NamedValue *v, size_t n) {
  for (size_t i = 0; v && i < n && i < 1024; i++) {
    put(t, prefix, strlen(prefix));
    put(t, v[i].name, v[i].name ? v[i].name_size : 0);
    put(t, "=", 1);
    switch (v[i].type) {
      case 0: put(t, v[i].value.s, v[i].value.s ? v[i].value_size : 0); break;
      case 1: putf(t, "%lld", (long long)v[i].value.i); break;
      case 2:
        for (size_t k = 0; v[i].value.list && k < v[i].value_size && k < 4096; k++)
          putf(t, k ? ",%lld" : "%lld", (long long)v[i].value.list[k]);
        break;
      case 3: putf(t, "%.9g", (double)v[i].value.f); break;
      case 4: putf(t, "%d", (int)v[i].value.b); break;
      default: putf(t, "?%d", v[i].type);
    }
    put(t, "\n", 1);
  }
}

/* One line per device: "id process kind", then its attributes (coordinates,
   core on chip...) as "  name=value" lines. */
static void devices(PJRT_Client *client, text *t) {
  Client_Devices_Args a = {sizeof a, NULL, client, NULL, 0};
  PJRT_Error *e = slot(SLOT_Client_Devices)(&a);
  if (e) {
    drop_error(e);
    return;
  }
  for (size_t i = 0; i < a.num_devices && i < 65536; i++) {
    Device_GetDescription_Args g = {sizeof g, NULL, a.devices[i], NULL};
    DeviceDescription_Int_Args id = {sizeof id, NULL, NULL, 0};
    DeviceDescription_Int_Args proc = {sizeof proc, NULL, NULL, 0};
    if ((e = slot(SLOT_Device_GetDescription)(&g))) break;
    id.description = proc.description = g.description;
    if ((e = slot(SLOT_DeviceDescription_Id)(&id))) break;
    if ((e = slot(SLOT_DeviceDescription_ProcessIndex)(&proc))) break;
    DeviceDescription_Kind_Args kind = {sizeof kind, NULL, g.description, NULL, 0};
    if ((e = slot(SLOT_DeviceDescription_Kind)(&kind))) break;
    putf(t, "%d %d ", id.value, proc.value);
    put(t, kind.kind, kind.kind ? kind.kind_size : 0);
    put(t, "\n", 1);
    DeviceDescription_Attributes_Args at = {sizeof at, NULL, g.description, 0, NULL};
    if ((e = slot(SLOT_DeviceDescription_Attributes)(&at))) break;
    put_named(t, "  ", at.attributes, at.num_attributes);
  }
  drop_error(e);
}

static char plugin_path[4096];

/* The plugin's build: its file (the worker hashes it), its PJRT C API version
   and the attributes it reports (XLA and StableHLO versions...). */
static void plugin(text *t) {
  putf(t, "path=%s\napi=%d.%d\n", plugin_path, real_api->pjrt_api_version.major_version,
       real_api->pjrt_api_version.minor_version);
  Plugin_Attributes_Args a = {sizeof a, NULL, NULL, 0};
  PJRT_Error *e = slot(SLOT_Plugin_Attributes)(&a);
  if (e) drop_error(e);
  else put_named(t, "attribute ", a.attributes, a.num_attributes);
}

/* What the plugin reads from this process's environment, NUL-separated. */
static void environment(text *t) {
  static const char *names[] = {"XLA_FLAGS", "LIBTPU_INIT_ARGS"};
  for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
    const char *v = getenv(names[i]);
    putf(t, "%s=", names[i]);
    if (v) put(t, v, strlen(v));
    put(t, "", 1); /* the NUL of "" ends the entry */
  }
}

/* ---- the compile ---------------------------------------------------------- */

static PJRT_Error *real_compile(Client_Compile_Args *args) {
  return slot(SLOT_Client_Compile)(args);
}

static int load_hit(Client_Compile_Args *args, const reply *r) {
  /* "HIT <key> <sha256>": only bytes that hash to what the worker verified. */
  const char *digest = strrchr(r->header, ' ');
  char got[65];
  sha256_hex(r->payload, r->payload_size, got);
  if (!digest || strlen(digest + 1) != 64 || strcmp(digest + 1, got) != 0) {
    say_once(64, "a shared executable did not hash to its digest: compiling");
    return -1;
  }
  DeserializeAndLoad_Args d = {sizeof d, NULL, args->client, r->payload, r->payload_size, NULL,
                               NULL, 0};
  PJRT_Error *e = slot(SLOT_Executable_DeserializeAndLoad)(&d);
  if (e) {
    char buf[320];
    say_once(4, "the plugin refused a shared executable (%s): compiling",
             error_text(e, buf, sizeof buf));
    drop_error(e);
    return -1;
  }
  args->executable = d.loaded;
  return 0;
}

/* Serialize what the real compile made and hand it to the worker to publish. */
static void publish(int fd, Client_Compile_Args *args, double seconds) {
  GetExecutable_Args g = {sizeof g, NULL, args->executable, NULL};
  PJRT_Error *e = slot(SLOT_LoadedExecutable_GetExecutable)(&g);
  Executable_Serialize_Args s = {sizeof s, NULL, NULL, NULL, 0, NULL, NULL};
  if (!e) {
    s.executable = g.executable;
    e = slot(SLOT_Executable_Serialize)(&s);
  }
  if (e) {
    char buf[320];
    say_once(8, "cannot serialize the executable (%s): not shared", error_text(e, buf, sizeof buf));
    drop_error(e);
    send_word(fd, "failed cannot serialize");
  } else {
    char header[128];
    snprintf(header, sizeof header, "publish %.6f", seconds);
    const void *blob = s.bytes;
    uint64_t size = s.bytes_size;
    /* The publish is bounded afresh (the compile itself may take long), by
       what a local socket needs for the bytes: the framework waits for it. */
    deadline = now() + transfer_s(size);
    if (send_frame(fd, header, 1, &blob, &size) == 0) {
      reply r;
      if (read_reply(fd, &r) == 0) {
        note("%s", r.header);
        free(r.payload);
      }
    }
    if (s.deleter) s.deleter(s.serialized);
  }
  if (g.executable) {
    Executable_Destroy_Args d = {sizeof d, NULL, g.executable};
    drop_error(slot(SLOT_Executable_Destroy)(&d));
  }
}

/* Ask the worker; -1 when it cannot be asked. */
static int ask(int fd, Client_Compile_Args *args, reply *r) {
  char name[64], version[256], header[1024], format[32];
  Client_ProcessIndex_Args p = {sizeof p, NULL, args->client, 0};
  PJRT_Error *e = slot(SLOT_Client_ProcessIndex)(&p);
  drop_error(e);
  client_string(SLOT_Client_PlatformName, args->client, name, sizeof name);
  client_string(SLOT_Client_PlatformVersion, args->client, version, sizeof version);
  const Program *prog = args->program;
  size_t nf = 0;
  for (size_t i = 0; prog->format && i < prog->format_size && nf < sizeof format - 1; i++)
    if (prog->format[i] >= 'a' && prog->format[i] <= 'z') format[nf++] = prog->format[i];
  format[nf] = 0;
  snprintf(header, sizeof header,
           "{\"op\":\"compile\",\"format\":\"%s\",\"platform\":\"%s\",\"platform_version\":\"%s\","
           "\"process_index\":%d,\"pid\":%d}",
           format, name, version, e ? 0 : p.process_index, (int)getpid());
  text devs = {0}, plug = {0}, env = {0};
  devices(args->client, &devs);
  plugin(&plug);
  environment(&env);
  const char *token = getenv("COMPILECAST_TOKEN");
  const void *blobs[6] = {prog->code, args->compile_options, devs.data, plug.data, env.data,
                          token};
  uint64_t sizes[6] = {prog->code_size, args->compile_options_size, devs.len, plug.len, env.len,
                       token ? strlen(token) : 0};
  int failed = devs.failed || plug.failed || env.failed ||
               send_frame(fd, header, 6, blobs, sizes) || read_reply(fd, r);
  free(devs.data);
  free(plug.data);
  free(env.data);
  if (failed) {
    say_once(16, "the worker did not answer a compile: compiling without compilecast");
    return -1;
  }
  return 0;
}

static PJRT_Error *our_compile(void *raw) {
  Client_Compile_Args *args = raw;
  const char *off = getenv("COMPILECAST_PJRT_ENABLE");
  if (off && strcmp(off, "0") == 0) return real_compile(args);
  int fd = connect_worker();
  if (fd < 0) {
    note("real compile (no worker)");
    return real_compile(args);
  }
  deadline = now() + exchange_s();
  reply r;
  PJRT_Error *e = NULL;
  if (ask(fd, args, &r) != 0) {
    close(fd);
    note("real compile (the worker did not answer)");
    return real_compile(args);
  }
  note("worker: %s", r.header);
  if (strncmp(r.header, "HIT ", 4) == 0 && r.payload) {
    int ok = load_hit(args, &r) == 0;
    free(r.payload);
    close(fd);
    if (ok) return NULL;
    note("real compile (the shared executable was refused)");
    return real_compile(args);
  }
  if (strncmp(r.header, "COMPILE ", 8) == 0) {
    double start = now();
    note("real compile (holding the lease)");
    /* The worker may hand back the options to compile with (a GPU job's
       compile that waits for no other process: no sharded autotuning). */
    const char *options = args->compile_options;
    size_t options_size = args->compile_options_size;
    if (r.payload) {
      args->compile_options = r.payload;
      args->compile_options_size = r.payload_size;
    }
    e = real_compile(args);
    args->compile_options = options;
    args->compile_options_size = options_size;
    if (e && r.payload) { /* options the plugin cannot use: the framework's own */
      char buf[320];
      say_once(128, "the plugin refused the compile options the worker handed back (%s): "
               "compiling with the framework's own", error_text(e, buf, sizeof buf));
      drop_error(e);
      e = real_compile(args);
    }
    free(r.payload);
    if (e) send_word(fd, "failed the compile failed");
    else publish(fd, args, now() - start);
    close(fd);
    return e;
  }
  free(r.payload);
  close(fd);
  note("real compile (%s)", r.header);
  return real_compile(args);
}

/* ---- loading -------------------------------------------------------------- */

static void load(void) {
  const char *path = getenv("COMPILECAST_PJRT_PLUGIN");
  if (!path || !*path) {
    fprintf(stderr, "compilecast-pjrt: COMPILECAST_PJRT_PLUGIN names no plugin to wrap\n");
    return;
  }
  if (!realpath(path, plugin_path)) snprintf(plugin_path, sizeof plugin_path, "%s", path);
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    fprintf(stderr, "compilecast-pjrt: cannot load %s: %s\n", path, dlerror());
    return;
  }
  const cc_Api *(*get)(void) = (const cc_Api *(*)(void))dlsym(lib, "GetPjrtApi");
  if (!get || !(real_api = get())) {
    fprintf(stderr, "compilecast-pjrt: %s has no GetPjrtApi\n", path);
    real_api = NULL;
    return;
  }
  size_t needed = offsetof(cc_Api, fns) + SLOT_COUNT_NEEDED * sizeof(cc_fn);
  if (real_api->pjrt_api_version.major_version != CC_PJRT_MAJOR || real_api->struct_size < needed) {
    say_once(32, "%s speaks PJRT C API %d.%d, this interposer %d.x: passed through untouched",
             path, real_api->pjrt_api_version.major_version,
             real_api->pjrt_api_version.minor_version, CC_PJRT_MAJOR);
    return;
  }
  our_api = malloc(real_api->struct_size);
  if (!our_api) return;
  memcpy(our_api, real_api, real_api->struct_size);
  our_api->fns[SLOT_Client_Compile] = (cc_fn)our_compile;
  note("wrapping %s (PJRT C API %d.%d)", path, real_api->pjrt_api_version.major_version,
       real_api->pjrt_api_version.minor_version);
}

__attribute__((visibility("default"))) const void *GetPjrtApi(void) {
  pthread_once(&loaded, load);
  return our_api ? (const void *)our_api : (const void *)real_api;
}
