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
 *                                            `message` for aclGetRecentErrMsg
 *   standin_log()                            every call so far, "name(args);" each
 *
 * Like the real runtime, aclInit reads ASCEND_RT_VISIBLE_DEVICES: ids separated by commas,
 * reading stops at the first entry that is not a plain number or not below the device count,
 * and aclrtGetDeviceCount then reports how many it kept.
 *
 * Build variants (-D):
 *   STANDIN_NO_DEVICE_INFO   omit aclrtGetDeviceInfo, as an older CANN: the crate must fall
 *                            back to aclGetDeviceCapability
 *   STANDIN_NO_SET_DEVICE    omit aclrtSetDevice, a required call: loading must fail
 *
 * All state is `static` and no exported function calls another, so two variants loaded with
 * RTLD_GLOBAL into one process cannot interpose on each other.
 */

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

static char g_log[16384];
static size_t g_log_len;
static uint32_t g_device_count;
static uint32_t g_visible_count;
static int64_t g_ai_cores;
static int64_t g_vector_cores;
static char g_soc_name[64];
static int g_initialized;
static char g_fail_call[64];
static int g_fail_code;
static char g_fail_message[256];
static char g_recent[256];
static char g_recent_out[256];

static void record(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    if (g_log_len < sizeof g_log) {
        int n = vsnprintf(g_log + g_log_len, sizeof g_log - g_log_len, fmt, args);
        if (n > 0) g_log_len += (size_t)n;
        if (g_log_len < sizeof g_log - 1) g_log[g_log_len++] = ';';
        if (g_log_len >= sizeof g_log) g_log_len = sizeof g_log - 1;
        g_log[g_log_len] = '\0';
    }
    va_end(args);
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

static void defaults(void) {
    g_log_len = 0;
    g_log[0] = '\0';
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

const char *standin_log(void) { return g_log; }

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

#ifndef STANDIN_NO_DEVICE_INFO
aclError aclrtGetDeviceInfo(uint32_t device_id, int attr, int64_t *value) {
    record("aclrtGetDeviceInfo(%u,%d)", device_id, attr);
    aclError status = injected("aclrtGetDeviceInfo");
    if (status != ACL_SUCCESS) return status;
    if (bad_device(device_id)) return ACL_ERROR_RT_INVALID_DEVICEID;
    return core_count(value, ATTR_AICORE_CORE_NUM, ATTR_VECTOR_CORE_NUM, attr);
}
#endif

aclError aclGetDeviceCapability(uint32_t device_id, int info, int64_t *value) {
    record("aclGetDeviceCapability(%u,%d)", device_id, info);
    aclError status = injected("aclGetDeviceCapability");
    if (status != ACL_SUCCESS) return status;
    if (bad_device(device_id)) return ACL_ERROR_RT_INVALID_DEVICEID;
    return core_count(value, INFO_AI_CORE_NUM, INFO_VECTOR_CORE_NUM, info);
}
