/*
 * TEST STAND-IN FOR THE CANN RUNTIME (libascendcl.so). NOT CANN, NOT A DRIVER, NO NPU.
 *
 * Used only by dist-tensor's tests/ascend_*.rs, which compile it (cc -shared -fPIC) into a
 * temporary directory under target/ and point dist_tensor::device::ascend at it, to exercise
 * the run-time loader end to end on machines without CANN. Nothing else builds, ships or loads
 * it.
 *
 * It exports the AscendCL C symbols the crate uses, with the signatures of CANN's public
 * headers (acl_base.h, acl_rt.h), plus test controls prefixed `standin_`:
 *
 *   standin_reset()                          back to the defaults below, log cleared
 *   standin_set_device_count(n)              devices reported (default 1)
 *   standin_set_cores(ai, vector)            core counts of every device (default 24, 48)
 *   standin_set_soc_name(name)               aclrtGetSocName's answer (default "Ascend910B3")
 *   standin_fail(call, code, message)        make `call` return `code` from now on, with
 *                                            `message` for aclGetRecentErrMsg (any stand-in's
 *                                            call: the others ask this one, see below)
 *   standin_log()                            every call so far, "name(args);" each, of every
 *                                            stand-in, in the order made
 *   standin_on_launch(kernel, arg, data, n)  when `kernel` is launched, copy `n` bytes of `data`
 *                                            to the address passed as its argument `arg` (a way
 *                                            to play a kernel that wrote its status record)
 *
 * Device memory is host memory (calloc); copies are memcpy; a launch records the kernel, its
 * block count and its arguments (as signed 64-bit values), runs nothing, and writes what
 * standin_on_launch asked for. The current context, and so the current device, is per thread,
 * as in CANN. Binaries come from the aclrtc stand-in: "STANDIN-ELF" followed by the names of
 * the kernels they hold, one per line.
 *
 * For the other stand-ins (aclrtc, SHMEM, HCCL, aclnn), which find these with
 * dlsym(RTLD_DEFAULT) since this library is opened with RTLD_GLOBAL:
 *   standin_record_line(line)                append a line to the shared log
 *   standin_injected_status(call)            the status standin_fail set for `call` (0: none),
 *                                            its message then ready for aclGetRecentErrMsg
 *   standin_set_recent(message)              the message aclGetRecentErrMsg gives next
 *   aclrtGetDevice(&id)                      the calling thread's current device
 *
 * All state is guarded by one mutex: the crate's ranks call from threads of their own.
 *
 * Like the real runtime, aclInit reads ASCEND_RT_VISIBLE_DEVICES: ids separated by commas,
 * reading stops at the first entry that is not a plain number or not below the device count,
 * and aclrtGetDeviceCount then reports how many it kept.
 *
 * Build variants (-D):
 *   STANDIN_EXECUTE          the executing stand-in: device memory is tracked (a kernel's global
 *                            accesses are checked against it), binaries are shared objects from
 *                            the executing aclrtc stand-in, and a launch runs the kernel on CPU
 *                            threads (tests/cann_stand_in/ascendc_cpu/), one per core of the
 *                            launch, with the device's core counts; a kernel that breaks a rule
 *                            fails at the stream's synchronisation (ACL_ERROR_RT_AICORE_EXCEPTION)
 *                            with a message naming the kernel, core and sub-core. Extra controls:
 *     standin_set_ub_bytes(n)          the unified buffer of every vector core (192 KiB)
 *     standin_set_launch_stagger(ms)   device d's kernels start d * ms later (makes a read
 *                                      that does not wait for its peer read stale data)
 *     standin_register_heap(pe, dev, base, size)   called by the SHMEM stand-in
 *   and after every launch a log line standin_first_remote(dev=D,kernel,pe=P): the first peer
 *   the core of block index 0 reached (its rank rotation, seen from outside).
 *   STANDIN_NO_DEVICE_INFO   omit aclrtGetDeviceInfo, as an older CANN: the crate must fall
 *                            back to aclGetDeviceCapability
 *   STANDIN_NO_SET_DEVICE    omit aclrtSetDevice, a required call: loading must fail
 *   STANDIN_NO_KERNEL_CALLS  omit the kernel-launch calls (aclrtBinaryLoadFromData, ...), as a
 *                            CANN older than 8.3
 *
 * All state is `static` and no exported function calls another, so two variants loaded with
 * RTLD_GLOBAL into one process cannot interpose on each other.
 */

#define _GNU_SOURCE
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "standin_launch_info.h"

typedef int aclError;

#define ACL_SUCCESS 0
#define ACL_ERROR_INVALID_PARAM 100000
#define ACL_ERROR_UNINITIALIZE 100001
#define ACL_ERROR_RT_INVALID_DEVICEID 107001

/* aclDeviceInfo (older query) and aclrtDevAttr (newer query). */
#define INFO_AI_CORE_NUM 0
#define INFO_VECTOR_CORE_NUM 1
#define ATTR_AICORE_CORE_NUM 101
#define ATTR_VECTOR_CORE_NUM 201

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static char *g_log;
static size_t g_log_len;
static size_t g_log_cap;
static uint32_t g_device_count;
static uint32_t g_visible_count;
static int64_t g_ai_cores;
static int64_t g_vector_cores;
static char g_soc_name[64];
static int g_initialized;
static char g_fail_call[64];
static int g_fail_code;
static char g_fail_message[256];
/* Per thread, as the runtime keeps them. */
static __thread char g_recent[1024];
static __thread char g_recent_out[1024];
static __thread int g_current = -1;

/* Appends one "line;" to the log (the caller holds g_lock). */
static void append(const char *line) {
    size_t n = strlen(line);
    if (g_log_len + n + 2 > g_log_cap) {
        size_t cap = g_log_cap == 0 ? 1 << 16 : g_log_cap;
        while (g_log_len + n + 2 > cap) cap *= 2;
        char *grown = realloc(g_log, cap);
        if (grown == NULL) return;
        g_log = grown;
        g_log_cap = cap;
    }
    memcpy(g_log + g_log_len, line, n);
    g_log_len += n;
    g_log[g_log_len++] = ';';
    g_log[g_log_len] = '\0';
}

static void record(const char *fmt, ...) {
    char line[1024];
    va_list args;
    va_start(args, fmt);
    vsnprintf(line, sizeof line, fmt, args);
    va_end(args);
    pthread_mutex_lock(&g_lock);
    append(line);
    pthread_mutex_unlock(&g_lock);
}

static void set_recent(const char *message) {
    snprintf(g_recent, sizeof g_recent, "%s", message);
}

/* The injected failure for `call`, if any: its code, with the message stored for
 * aclGetRecentErrMsg. */
static aclError injected(const char *call) {
    if (g_fail_code != 0 && strcmp(call, g_fail_call) == 0) {
        set_recent(g_fail_message);
        return g_fail_code;
    }
    return ACL_SUCCESS;
}

static void clear_launch_writes(void);
static void exec_defaults(void);

static void defaults(void) {
    exec_defaults();
    g_log_len = 0;
    if (g_log != NULL) g_log[0] = '\0';
    clear_launch_writes();
    g_device_count = 1;
    g_visible_count = 1;
    g_ai_cores = 24;
    g_vector_cores = 48;
    snprintf(g_soc_name, sizeof g_soc_name, "%s", "Ascend910B3");
    g_initialized = 0;
    g_fail_call[0] = '\0';
    g_fail_code = 0;
    g_fail_message[0] = '\0';
    g_recent[0] = '\0';
}

/* Loaded once per process (or per dlopen after a dlclose): start from the defaults. */
__attribute__((constructor)) static void on_load(void) { defaults(); }

static uint32_t visible_count(void) {
    const char *value = getenv("ASCEND_RT_VISIBLE_DEVICES");
    if (value == NULL) return g_device_count;
    uint32_t kept = 0;
    const char *p = value;
    while (*p != '\0') {
        if (*p < '0' || *p > '9') break;
        unsigned long id = strtoul(p, (char **)&p, 10);
        if (id >= g_device_count) break;
        kept++;
        if (*p == ',') p++;
        else if (*p != '\0') break;
    }
    return kept;
}

static int bad_device(int64_t id) {
    if (id < 0 || (uint64_t)id >= g_visible_count) {
        char message[128];
        snprintf(message, sizeof message, "EE1001: invalid device id %lld (stand-in sees %u)",
                 (long long)id, g_visible_count);
        set_recent(message);
        return 1;
    }
    return 0;
}

/* ---- controls for the tests ---------------------------------------------------------- */

void standin_reset(void) { defaults(); }

void standin_set_device_count(uint32_t count) { g_device_count = count; g_visible_count = count; }

void standin_set_cores(int64_t ai_cores, int64_t vector_cores) {
    g_ai_cores = ai_cores;
    g_vector_cores = vector_cores;
}

void standin_set_soc_name(const char *name) { snprintf(g_soc_name, sizeof g_soc_name, "%s", name); }

void standin_fail(const char *call, int code, const char *message) {
    snprintf(g_fail_call, sizeof g_fail_call, "%s", call);
    g_fail_code = code;
    snprintf(g_fail_message, sizeof g_fail_message, "%s", message);
}

const char *standin_log(void) { return g_log == NULL ? "" : g_log; }

void standin_record_line(const char *line) {
    pthread_mutex_lock(&g_lock);
    append(line);
    pthread_mutex_unlock(&g_lock);
}

void standin_set_recent(const char *message) { set_recent(message); }

int standin_injected_status(const char *call) {
    pthread_mutex_lock(&g_lock);
    int status = injected(call);
    pthread_mutex_unlock(&g_lock);
    return status;
}

/* What standin_on_launch asked for. */
struct launch_write {
    char kernel[64];
    int arg;
    unsigned char *data;
    size_t len;
};
static struct launch_write g_writes[8];
static int g_write_count;

static void clear_launch_writes(void) {
    for (int i = 0; i < g_write_count; i++) free(g_writes[i].data);
    g_write_count = 0;
}

void standin_on_launch(const char *kernel, int arg, const void *data, size_t len) {
    pthread_mutex_lock(&g_lock);
    if (g_write_count < 8) {
        struct launch_write *w = &g_writes[g_write_count++];
        snprintf(w->kernel, sizeof w->kernel, "%s", kernel);
        w->arg = arg;
        w->data = malloc(len);
        memcpy(w->data, data, len);
        w->len = len;
    }
    pthread_mutex_unlock(&g_lock);
}

/* ---- AscendCL ------------------------------------------------------------------------ */

aclError aclInit(const char *config_path) {
    record("aclInit(%s)", config_path == NULL ? "NULL" : config_path);
    aclError status = injected("aclInit");
    if (status != ACL_SUCCESS) return status;
    g_initialized = 1;
    g_visible_count = visible_count();
    return ACL_SUCCESS;
}

aclError aclFinalize(void) {
    record("aclFinalize");
    g_initialized = 0;
    return injected("aclFinalize");
}

aclError aclrtGetDeviceCount(uint32_t *count) {
    record("aclrtGetDeviceCount");
    aclError status = injected("aclrtGetDeviceCount");
    if (status != ACL_SUCCESS) return status;
    if (!g_initialized) {
        set_recent("EE1002: aclInit has not been called (stand-in)");
        return ACL_ERROR_UNINITIALIZE;
    }
    *count = g_visible_count;
    return ACL_SUCCESS;
}

#ifndef STANDIN_NO_SET_DEVICE
aclError aclrtSetDevice(int32_t device_id) {
    record("aclrtSetDevice(%d)", device_id);
    aclError status = injected("aclrtSetDevice");
    if (status != ACL_SUCCESS) return status;
    if (bad_device(device_id)) return ACL_ERROR_RT_INVALID_DEVICEID;
    g_current = device_id;
    return ACL_SUCCESS;
}
#endif

aclError aclrtResetDevice(int32_t device_id) {
    record("aclrtResetDevice(%d)", device_id);
    aclError status = injected("aclrtResetDevice");
    if (status != ACL_SUCCESS) return status;
    if (bad_device(device_id)) return ACL_ERROR_RT_INVALID_DEVICEID;
    return ACL_SUCCESS;
}

const char *aclrtGetSocName(void) {
    record("aclrtGetSocName");
    if (injected("aclrtGetSocName") != ACL_SUCCESS) return NULL;
    return g_soc_name;
}

/* Returns the message of the most recent failure on this thread, and clears it. */
const char *aclGetRecentErrMsg(void) {
    record("aclGetRecentErrMsg");
    if (g_recent[0] == '\0') return NULL;
    snprintf(g_recent_out, sizeof g_recent_out, "%s", g_recent);
    g_recent[0] = '\0';
    return g_recent_out;
}

static aclError core_count(int64_t *value, int ai, int vector, int which) {
    if (value == NULL) {
        set_recent("EE1003: value is NULL (stand-in)");
        return ACL_ERROR_INVALID_PARAM;
    }
    if (which == ai) {
        *value = g_ai_cores;
    } else if (which == vector) {
        *value = g_vector_cores;
    } else {
        set_recent("EE1004: unsupported query (stand-in)");
        return ACL_ERROR_INVALID_PARAM;
    }
    return ACL_SUCCESS;
}

/* A core count asked by `call` (recorded) of `device_id`: `asked` is its `ai_core` or `vector` key. */
static aclError device_core_count(const char *call, uint32_t device_id, int64_t *value, int ai_core, int vector,
                                  int asked) {
    record("%s(%u,%d)", call, device_id, asked);
    aclError status = injected(call);
    if (status != ACL_SUCCESS) return status;
    if (bad_device(device_id)) return ACL_ERROR_RT_INVALID_DEVICEID;
    return core_count(value, ai_core, vector, asked);
}

#ifndef STANDIN_NO_DEVICE_INFO
aclError aclrtGetDeviceInfo(uint32_t device_id, int attr, int64_t *value) {
    return device_core_count("aclrtGetDeviceInfo", device_id, value, ATTR_AICORE_CORE_NUM, ATTR_VECTOR_CORE_NUM, attr);
}
#endif

aclError aclGetDeviceCapability(uint32_t device_id, int info, int64_t *value) {
    return device_core_count("aclGetDeviceCapability", device_id, value, INFO_AI_CORE_NUM, INFO_VECTOR_CORE_NUM, info);
}


/* ---- device memory the executing stand-in's kernels may touch ----------------------------- */

#ifdef STANDIN_EXECUTE
#include <dlfcn.h>
#include <time.h>
#include <unistd.h>

struct region { const unsigned char *base; size_t size; };
static pthread_rwlock_t g_regions_lock = PTHREAD_RWLOCK_INITIALIZER;
static struct region *g_regions;
static size_t g_region_count, g_region_cap;

/* Symmetric heaps, by PE, registered by the SHMEM stand-in. */
#define MAX_HEAPS 64
static struct standin_heap g_heaps[MAX_HEAPS];
static int g_heap_device[MAX_HEAPS];
static uint64_t g_ub_bytes = 192 * 1024;
static int g_stagger_ms;

static void track(void *ptr, size_t size) {
    pthread_rwlock_wrlock(&g_regions_lock);
    if (g_region_count == g_region_cap) {
        g_region_cap = g_region_cap == 0 ? 64 : g_region_cap * 2;
        g_regions = realloc(g_regions, g_region_cap * sizeof *g_regions);
    }
    g_regions[g_region_count].base = ptr;
    g_regions[g_region_count].size = size;
    g_region_count++;
    pthread_rwlock_unlock(&g_regions_lock);
}

static void untrack(void *ptr) {
    pthread_rwlock_wrlock(&g_regions_lock);
    for (size_t i = 0; i < g_region_count; i++) {
        if (g_regions[i].base == ptr) {
            g_regions[i] = g_regions[--g_region_count];
            break;
        }
    }
    pthread_rwlock_unlock(&g_regions_lock);
}

/* Whether [p, p + len) lies inside one device allocation or one PE's heap. */
static int gm_valid(const void *p, size_t len) {
    const unsigned char *b = p;
    int ok = 0;
    pthread_rwlock_rdlock(&g_regions_lock);
    for (size_t i = 0; i < g_region_count && !ok; i++) {
        if (b >= g_regions[i].base && b + len <= g_regions[i].base + g_regions[i].size) ok = 1;
    }
    for (int pe = 0; pe < MAX_HEAPS && !ok; pe++) {
        const unsigned char *base = g_heaps[pe].base;
        if (base != NULL && b >= base && b + len <= base + g_heaps[pe].size) ok = 1;
    }
    pthread_rwlock_unlock(&g_regions_lock);
    return ok;
}

void standin_register_heap(int pe, int device, void *base, size_t size) {
    if (pe < 0 || pe >= MAX_HEAPS) return;
    pthread_rwlock_wrlock(&g_regions_lock);
    g_heaps[pe].base = base;
    g_heaps[pe].size = size;
    g_heap_device[pe] = device;
    pthread_rwlock_unlock(&g_regions_lock);
}

void standin_set_ub_bytes(uint64_t bytes) { g_ub_bytes = bytes; }

void standin_set_launch_stagger(int ms) { g_stagger_ms = ms; }

static void exec_defaults(void) {
    g_ub_bytes = 192 * 1024;
    g_stagger_ms = 0;
}
#else
static void exec_defaults(void) {}
static void track(void *ptr, size_t size) { (void)ptr; (void)size; }
static void untrack(void *ptr) { (void)ptr; }
#endif

/* ---- contexts, streams, memory -------------------------------------------------------- */

#define ACL_ERROR_RT_CONTEXT_NULL 107002
#define ACL_ERROR_RT_PARAM_INVALID 107000

struct context { int device; };
struct stream { int device; int error; char message[1024]; };

/* The calling thread's current device; -1 when none is set. */
aclError aclrtGetDevice(int32_t *device_id) {
    if (g_current < 0) {
        set_recent("EE1007: no device is current on this thread (stand-in)");
        return ACL_ERROR_RT_CONTEXT_NULL;
    }
    *device_id = g_current;
    return ACL_SUCCESS;
}

aclError aclrtCreateContext(void **context, int32_t device_id) {
    record("aclrtCreateContext(%d)", device_id);
    aclError status = injected("aclrtCreateContext");
    if (status != ACL_SUCCESS) return status;
    if (bad_device(device_id)) return ACL_ERROR_RT_INVALID_DEVICEID;
    struct context *c = malloc(sizeof *c);
    c->device = device_id;
    *context = c;
    g_current = device_id;
    return ACL_SUCCESS;
}

aclError aclrtDestroyContext(void *context) {
    struct context *c = context;
    record("aclrtDestroyContext(%d)", c == NULL ? -1 : c->device);
    aclError status = injected("aclrtDestroyContext");
    if (status != ACL_SUCCESS) return status;
    free(c);
    return ACL_SUCCESS;
}

aclError aclrtSetCurrentContext(void *context) {
    struct context *c = context;
    aclError status = injected("aclrtSetCurrentContext");
    if (status != ACL_SUCCESS) return status;
    if (c == NULL) {
        set_recent("EE1008: null context (stand-in)");
        return ACL_ERROR_RT_CONTEXT_NULL;
    }
    g_current = c->device;
    return ACL_SUCCESS;
}

aclError aclrtCreateStream(void **stream) {
    record("aclrtCreateStream(dev=%d)", g_current);
    aclError status = injected("aclrtCreateStream");
    if (status != ACL_SUCCESS) return status;
    struct stream *s = calloc(1, sizeof *s);
    s->device = g_current;
    *stream = s;
    return ACL_SUCCESS;
}

aclError aclrtDestroyStream(void *stream) {
    struct stream *s = stream;
    record("aclrtDestroyStream(dev=%d)", s == NULL ? -1 : s->device);
    free(s);
    return injected("aclrtDestroyStream");
}

/* A kernel's failure, kept on its stream, comes back at the stream's synchronisation. */
static aclError stream_error(struct stream *s) {
    if (s->error == 0) return ACL_SUCCESS;
    aclError status = s->error;
    set_recent(s->message);
    s->error = 0;
    return status;
}

aclError aclrtSynchronizeStream(void *stream) {
    struct stream *s = stream;
    record("aclrtSynchronizeStream(dev=%d)", s->device);
    aclError status = injected("aclrtSynchronizeStream");
    return status != ACL_SUCCESS ? status : stream_error(s);
}

aclError aclrtSynchronizeStreamWithTimeout(void *stream, int32_t timeout_ms) {
    struct stream *s = stream;
    record("aclrtSynchronizeStreamWithTimeout(dev=%d,%s)", s->device, timeout_ms > 0 ? "timeout" : "no-timeout");
    aclError status = injected("aclrtSynchronizeStreamWithTimeout");
    return status != ACL_SUCCESS ? status : stream_error(s);
}

aclError aclrtMalloc(void **ptr, size_t size, int policy) {
    record("aclrtMalloc(dev=%d,%zu)", g_current, size);
    (void)policy;
    aclError status = injected("aclrtMalloc");
    if (status != ACL_SUCCESS) return status;
    if (size == 0) {
        set_recent("EE1009: size 0 (stand-in)");
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    *ptr = calloc(1, size);
    track(*ptr, size);
    return ACL_SUCCESS;
}

aclError aclrtFree(void *ptr) {
    record("aclrtFree(dev=%d)", g_current);
    untrack(ptr);
    free(ptr);
    return injected("aclrtFree");
}

aclError aclrtMemcpy(void *dst, size_t dest_max, const void *src, size_t count, int kind) {
    static const char *kinds[] = {"H2H", "H2D", "D2H", "D2D"};
    record("aclrtMemcpy(dev=%d,%s,%zu)", g_current, kind >= 0 && kind < 4 ? kinds[kind] : "?", count);
    aclError status = injected("aclrtMemcpy");
    if (status != ACL_SUCCESS) return status;
    if (count > dest_max) {
        set_recent("EE1010: count exceeds destMax (stand-in)");
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    memcpy(dst, src, count);
    return ACL_SUCCESS;
}

/* ---- loading and launching kernels (CANN 8.3) ---------------------------------------- */

#ifndef STANDIN_NO_KERNEL_CALLS

#define MAX_ARGS 64

struct binary { int device; char *text; void *so; };
struct function { int device; char name[64]; void *fn; void *launch; int mix; };
struct args { struct function *func; int count; int64_t values[MAX_ARGS]; size_t sizes[MAX_ARGS]; int finalized; };

typedef struct { int type; uint32_t value[4]; } load_option;
typedef struct { load_option *options; size_t count; } load_options;

aclError aclrtBinaryLoadFromData(const void *data, size_t length, const load_options *options, void **bin) {
    uint32_t magic = options != NULL && options->count > 0 ? options->options[0].value[0] : 0;
    record("aclrtBinaryLoadFromData(dev=%d,%zu bytes,magic=0x%08x)", g_current, length, magic);
    aclError status = injected("aclrtBinaryLoadFromData");
    if (status != ACL_SUCCESS) return status;
    if (length < 11 || memcmp(data, "STANDIN-ELF", 11) != 0) {
        set_recent("EE1011: not a device binary (stand-in)");
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    struct binary *b = calloc(1, sizeof *b);
    b->device = g_current;
    b->text = malloc(length + 1);
    memcpy(b->text, data, length);
    b->text[length] = '\0';
#ifdef STANDIN_EXECUTE
    /* The executing aclrtc's binary: its text header, then the shared object. */
    static const char marker[] = "\nshared-object-follows\n";
    const char *at = memmem(data, length, marker, sizeof marker - 1);
    if (at == NULL) {
        set_recent("EE1015: not a binary of the executing aclrtc stand-in (no shared object)");
        free(b->text);
        free(b);
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    const char *so = at + sizeof marker - 1;
    size_t so_len = length - (size_t)(so - (const char *)data);
    char path[] = "/tmp/dist-tensor-standin-kernel-XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0 || write(fd, so, so_len) != (ssize_t)so_len) {
        if (fd >= 0) close(fd);
        set_recent("EE1016: cannot write the kernel's shared object (stand-in)");
        free(b->text);
        free(b);
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    close(fd);
    b->so = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    unlink(path);
    if (b->so == NULL) {
        char message[512];
        snprintf(message, sizeof message, "EE1017: cannot load the kernel's shared object: %s (stand-in)", dlerror());
        set_recent(message);
        free(b->text);
        free(b);
        return ACL_ERROR_RT_PARAM_INVALID;
    }
#endif
    *bin = b;
    return ACL_SUCCESS;
}

aclError aclrtBinaryGetFunction(void *bin, const char *name, void **func) {
    struct binary *b = bin;
    record("aclrtBinaryGetFunction(dev=%d,%s)", b->device, name);
    aclError status = injected("aclrtBinaryGetFunction");
    if (status != ACL_SUCCESS) return status;
    char wanted[80];
    snprintf(wanted, sizeof wanted, "\nkernel %s\n", name);
    if (strstr(b->text, wanted) == NULL) {
        char message[160];
        snprintf(message, sizeof message, "EE1012: the binary has no kernel %s (stand-in)", name);
        set_recent(message);
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    struct function *f = calloc(1, sizeof *f);
    f->device = b->device;
    snprintf(f->name, sizeof f->name, "%s", name);
#ifdef STANDIN_EXECUTE
    f->fn = dlsym(b->so, name);
    f->launch = dlsym(b->so, "standin_kernel_launch");
    snprintf(wanted, sizeof wanted, "\nmix %s\n", name);
    f->mix = strstr(b->text, wanted) != NULL;
    if (f->fn == NULL || f->launch == NULL) {
        set_recent("EE1018: the kernel's shared object lacks its entry point (stand-in)");
        free(f);
        return ACL_ERROR_RT_PARAM_INVALID;
    }
#endif
    *func = f;
    return ACL_SUCCESS;
}

aclError aclrtBinaryUnLoad(void *bin) {
    struct binary *b = bin;
    record("aclrtBinaryUnLoad(dev=%d)", b->device);
#ifdef STANDIN_EXECUTE
    if (b->so != NULL) dlclose(b->so);
#endif
    free(b->text);
    free(b);
    return injected("aclrtBinaryUnLoad");
}

aclError aclrtKernelArgsInit(void *func, void **args) {
    struct function *f = func;
    record("aclrtKernelArgsInit(dev=%d,%s)", f->device, f->name);
    aclError status = injected("aclrtKernelArgsInit");
    if (status != ACL_SUCCESS) return status;
    struct args *a = calloc(1, sizeof *a);
    a->func = f;
    *args = a;
    return ACL_SUCCESS;
}

aclError aclrtKernelArgsAppend(void *args, void *param, size_t size, void **param_handle) {
    struct args *a = args;
    aclError status = injected("aclrtKernelArgsAppend");
    if (status != ACL_SUCCESS) return status;
    if (a->finalized || a->count >= MAX_ARGS || size > 8) {
        set_recent("EE1013: cannot append this argument (stand-in)");
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    int64_t value = 0;
    memcpy(&value, param, size);
    a->values[a->count] = value;
    a->sizes[a->count] = size;
    *param_handle = &a->values[a->count];
    a->count++;
    return ACL_SUCCESS;
}

aclError aclrtKernelArgsFinalize(void *args) {
    struct args *a = args;
    record("aclrtKernelArgsFinalize(dev=%d,%s,%d args)", a->func->device, a->func->name, a->count);
    a->finalized = 1;
    return injected("aclrtKernelArgsFinalize");
}

#ifdef STANDIN_EXECUTE
#define ACL_ERROR_RT_AICORE_EXCEPTION 507015

/* Runs the kernel to its end on CPU threads (the launch is synchronous here; the stream keeps
 * its failure for the synchronisation). */
static void run_kernel(struct function *f, uint32_t blocks, struct stream *s, struct args *a) {
    struct standin_heap heaps[MAX_HEAPS];
    int my_pe = -1, n_pes = 0;
    pthread_rwlock_rdlock(&g_regions_lock);
    for (int pe = 0; pe < MAX_HEAPS; pe++) {
        heaps[pe] = g_heaps[pe];
        if (heaps[pe].base != NULL) {
            n_pes = pe + 1;
            if (g_heap_device[pe] == s->device) my_pe = pe;
        }
    }
    pthread_rwlock_unlock(&g_regions_lock);
    if (g_stagger_ms > 0) {
        struct timespec nap = {0, 0};
        long ms = (long)g_stagger_ms * s->device;
        nap.tv_sec = ms / 1000;
        nap.tv_nsec = (ms % 1000) * 1000000L;
        nanosleep(&nap, NULL);
    }
    char error[1024] = {0};
    struct standin_launch_info info = {
        f->name, f->fn, blocks, f->mix, g_ai_cores > 0 ? (int)(g_vector_cores / g_ai_cores) : 1,
        a->values, a->count, my_pe, n_pes, heaps, gm_valid, g_ub_bytes, error, sizeof error, -1,
    };
    int (*launch)(struct standin_launch_info *) = (int (*)(struct standin_launch_info *))f->launch;
    int failed = launch(&info);
    record("standin_first_remote(dev=%d,%s,pe=%d)", s->device, f->name, info.first_remote_pe);
    if (failed != 0) {
        s->error = ACL_ERROR_RT_AICORE_EXCEPTION;
        snprintf(s->message, sizeof s->message, "EZ9999: the kernel failed (executing stand-in): %s", error);
    }
}
#endif

aclError aclrtLaunchKernelWithConfig(void *func, uint32_t blocks, void *stream, void *cfg, void *args, void *reserve) {
    struct function *f = func;
    struct args *a = args;
    struct stream *s = stream;
    char line[1024];
    int n = snprintf(line, sizeof line, "aclrtLaunchKernelWithConfig(dev=%d,%s,blocks=%u,args=", s->device, f->name, blocks);
    for (int i = 0; i < a->count && n < (int)sizeof line - 24; i++) {
        n += snprintf(line + n, sizeof line - n, "%s%lld", i == 0 ? "" : ":", (long long)a->values[i]);
    }
    snprintf(line + n, sizeof line - n, ")");
    pthread_mutex_lock(&g_lock);
    append(line);
    aclError status = injected("aclrtLaunchKernelWithConfig");
    if (status == ACL_SUCCESS && (cfg != NULL || reserve != NULL || !a->finalized || f->device != s->device)) {
        set_recent("EE1014: launch with a config, a reserve, unfinalised arguments or another device's stream (stand-in)");
        status = ACL_ERROR_RT_PARAM_INVALID;
    }
    if (status == ACL_SUCCESS) {
        for (int i = 0; i < g_write_count; i++) {
            struct launch_write *w = &g_writes[i];
            if (strcmp(w->kernel, f->name) == 0 && w->arg < a->count) {
                memcpy((void *)(intptr_t)a->values[w->arg], w->data, w->len);
            }
        }
    }
    pthread_mutex_unlock(&g_lock);
#ifdef STANDIN_EXECUTE
    if (status == ACL_SUCCESS) run_kernel(f, blocks, s, a);
#endif
    free(a);
    return status;
}

#endif
