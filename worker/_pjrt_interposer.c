/* compilecast's PJRT interposer: a PJRT plugin that wraps another.
 *
 * Loaded by a framework as its PJRT plugin (GetPjrtApi), it loads the real
 * plugin named by COMPILECAST_PJRT_PLUGIN and hands the framework the real
 * plugin's function table, with PJRT_Client_Compile replaced. A compile asks
 * the host's worker (COMPILECAST_WORKER's unix socket + ".pjrt",
 * worker/pjrtgate.py) with the program, its serialized compile options and
 * the platform; the worker keys it and answers:
 *   HIT      the serialized executable: loaded with
 *            PJRT_Executable_DeserializeAndLoad;
 *   COMPILE  this process holds the compile lease: the real compile, then
 *            PJRT_Executable_Serialize, sent to the worker to publish;
 *   LOCAL    compile with the real plugin and share nothing.
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
  SLOT_Client_PlatformName = 12,
  SLOT_Client_ProcessIndex = 13,
  SLOT_Client_PlatformVersion = 14,
  SLOT_Client_Devices = 15,
  SLOT_Client_Compile = 20,
  SLOT_DeviceDescription_Id = 23,
  SLOT_DeviceDescription_ProcessIndex = 24,
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

/* ---- the worker's socket -------------------------------------------------- */

static int write_all(int fd, const void *data, size_t n) {
  const char *p = data;
  while (n) {
    ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    p += k;
    n -= (size_t)k;
  }
  return 0;
}

static int read_all(int fd, void *data, size_t n) {
  char *p = data;
  while (n) {
    ssize_t k = recv(fd, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    p += k;
    n -= (size_t)k;
  }
  return 0;
}

/* A frame: "CCP1", u32 header size, header, u64 size, bytes, u64 size, bytes. */
static int send_frame(int fd, const char *header, const void *a, uint64_t na,
                      const void *b, uint64_t nb) {
  uint32_t nh = (uint32_t)strlen(header);
  if (write_all(fd, "CCP1", 4) || write_all(fd, &nh, 4) || write_all(fd, header, nh) ||
      write_all(fd, &na, 8) || (na && write_all(fd, a, na)) || write_all(fd, &nb, 8) ||
      (nb && write_all(fd, b, nb)))
    return -1;
  return 0;
}

/* A reply: "CCP1", u32 header size, header ("WORD reason"), u64 size, bytes. */
typedef struct {
  char header[1024];
  char *payload;
  uint64_t payload_size;
} reply;

static int read_reply(int fd, reply *r) {
  char magic[4];
  uint32_t nh;
  memset(r, 0, sizeof *r);
  if (read_all(fd, magic, 4) || memcmp(magic, "CCP1", 4) || read_all(fd, &nh, 4)) return -1;
  if (nh >= sizeof r->header) return -1;
  if (read_all(fd, r->header, nh) || read_all(fd, &r->payload_size, 8)) return -1;
  if (r->payload_size > ((uint64_t)1 << 40)) return -1;
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
  /* The worker ends every wait itself (its share-binary timeout); this bound
     only keeps a worker that stopped answering from holding the compile. */
  const char *limit = getenv("COMPILECAST_PJRT_TIMEOUT_S");
  struct timeval tv = {limit && atoi(limit) > 0 ? atoi(limit) : 3600, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  return fd;
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

/* "id:process,id:process,..." of the client's devices (at most 4,096). */
static void devices(PJRT_Client *client, char *out, size_t len) {
  Client_Devices_Args a = {sizeof a, NULL, client, NULL, 0};
  size_t used = 0;
  out[0] = 0;
  PJRT_Error *e = slot(SLOT_Client_Devices)(&a);
  if (e) {
    drop_error(e);
    return;
  }
  for (size_t i = 0; i < a.num_devices && i < 4096; i++) {
    Device_GetDescription_Args g = {sizeof g, NULL, a.devices[i], NULL};
    DeviceDescription_Int_Args id = {sizeof id, NULL, NULL, 0};
    DeviceDescription_Int_Args proc = {sizeof proc, NULL, NULL, 0};
    if ((e = slot(SLOT_Device_GetDescription)(&g))) break;
    id.description = proc.description = g.description;
    if ((e = slot(SLOT_DeviceDescription_Id)(&id))) break;
    if ((e = slot(SLOT_DeviceDescription_ProcessIndex)(&proc))) break;
    int k = snprintf(out + used, len - used, "%s%d:%d", i ? "," : "", id.value, proc.value);
    if (k < 0 || (size_t)k >= len - used) break;
    used += (size_t)k;
  }
  drop_error(e);
}

/* ---- the compile ---------------------------------------------------------- */

static PJRT_Error *real_compile(Client_Compile_Args *args) {
  return slot(SLOT_Client_Compile)(args);
}

static int load_hit(Client_Compile_Args *args, const reply *r) {
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
  char header[128];
  if (!e) {
    s.executable = g.executable;
    e = slot(SLOT_Executable_Serialize)(&s);
  }
  if (e) {
    char buf[320];
    snprintf(header, sizeof header, "failed cannot serialize");
    say_once(8, "cannot serialize the executable (%s): not shared", error_text(e, buf, sizeof buf));
    drop_error(e);
    send_frame(fd, header, NULL, 0, NULL, 0);
  } else {
    snprintf(header, sizeof header, "publish %.6f", seconds);
    if (send_frame(fd, header, s.bytes, s.bytes_size, NULL, 0) == 0) {
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

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}

/* Ask the worker; -1 when it cannot be asked. */
static int ask(int fd, Client_Compile_Args *args, reply *r) {
  char name[64], version[256], devs[16384], header[17000], proc_buf[16];
  Client_ProcessIndex_Args p = {sizeof p, NULL, args->client, 0};
  PJRT_Error *e = slot(SLOT_Client_ProcessIndex)(&p);
  drop_error(e);
  snprintf(proc_buf, sizeof proc_buf, "%d", e ? 0 : p.process_index);
  client_string(SLOT_Client_PlatformName, args->client, name, sizeof name);
  client_string(SLOT_Client_PlatformVersion, args->client, version, sizeof version);
  devices(args->client, devs, sizeof devs);
  const Program *prog = args->program;
  char format[32];
  snprintf(format, sizeof format, "%.*s", (int)(prog->format_size < 31 ? prog->format_size : 31),
           prog->format ? prog->format : "");
  snprintf(header, sizeof header,
           "{\"op\":\"compile\",\"format\":\"%s\",\"platform\":\"%s\",\"platform_version\":\"%s\","
           "\"process_index\":%s,\"pid\":%d,\"devices\":\"%s\"}",
           format, name, version, proc_buf, (int)getpid(), devs);
  if (send_frame(fd, header, prog->code, prog->code_size, args->compile_options,
                 args->compile_options_size) ||
      read_reply(fd, r)) {
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
  reply r;
  PJRT_Error *e = NULL;
  if (ask(fd, args, &r) != 0) {
    close(fd);
    note("real compile (the worker did not answer)");
    return real_compile(args);
  }
  note("worker: %s", r.header);
  if (strncmp(r.header, "HIT", 3) == 0 && r.payload) {
    int ok = load_hit(args, &r) == 0;
    free(r.payload);
    close(fd);
    if (ok) return NULL;
    note("real compile (the shared executable was refused)");
    return real_compile(args);
  }
  free(r.payload);
  if (strncmp(r.header, "COMPILE", 7) == 0) {
    double start = now();
    note("real compile (holding the lease)");
    e = real_compile(args);
    if (e) send_frame(fd, "failed the compile failed", NULL, 0, NULL, 0);
    else publish(fd, args, now() - start);
    close(fd);
    return e;
  }
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
