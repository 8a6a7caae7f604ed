/*
 * TEST STAND-IN FOR CANN'S RUN-TIME COMPILER (libacl_rtc.so, acl/acl_rt_compile.h). NOT A
 * COMPILER: IT COMPILES NOTHING.
 *
 * Used only by dist-tensor's tests/ascend_*.rs, which build it beside the AscendCL stand-in so
 * that the crate's call sequence (create, compile with the architecture option, get the binary,
 * destroy) and its error handling can be checked on machines without CANN.
 *
 * aclrtcCompileProg fails, with a compile log, when
 *   - no option is --npu-arch=... (ACL_ERROR_RTC_INVALID_OPTION),
 *   - the source still #includes a header of the crate's ("prelude.h", "gemm.h",
 *     "collective.h"): aclrtc takes no header files, so the crate must paste them in,
 *   - the source has no `extern "C" __global__ __aicore__ void <name>(` entry point for the
 *     program's name,
 *   - or the AscendCL stand-in was told to fail "aclrtcCompileProg" (standin_fail), whose
 *     message then is the log.
 * Otherwise the "binary" is "STANDIN-ELF", then "kernel <name>" for every entry point of the
 * source, then "option <option>" for every option, one per line: what the AscendCL stand-in's
 * aclrtBinaryLoadFromData and aclrtBinaryGetFunction check.
 *
 * Every call is recorded in the AscendCL stand-in's log (found with dlsym).
 */

#include "stand_in_log.h"
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int aclError;
#define ACL_SUCCESS 0
#define ACL_ERROR_RTC_INVALID_PROG 176000
#define ACL_ERROR_RTC_INVALID_INPUT 176001
#define ACL_ERROR_RTC_INVALID_OPTION 176002
#define ACL_ERROR_RTC_COMPILATION 176003

struct prog {
    char name[128];
    char *src;
    char *log;
    char *bin;
    size_t bin_len;
};

static const char *(*recent(void))(void) {
    return (const char *(*)(void))dlsym(RTLD_DEFAULT, "aclGetRecentErrMsg");
}

aclError aclrtcCreateProg(void **prog, const char *src, const char *name, int num_headers, const char **headers,
                          const char **include_names) {
    record("aclrtcCreateProg(%s,%zu bytes,%d headers)", name == NULL ? "NULL" : name, src == NULL ? 0 : strlen(src),
           num_headers);
    (void)headers;
    (void)include_names;
    if (prog == NULL || src == NULL || num_headers != 0) return ACL_ERROR_RTC_INVALID_INPUT;
    struct prog *p = calloc(1, sizeof *p);
    snprintf(p->name, sizeof p->name, "%s", name == NULL || name[0] == '\0' ? "default_program" : name);
    p->src = strdup(src);
    *prog = p;
    return ACL_SUCCESS;
}

static void set_log(struct prog *p, const char *text) {
    free(p->log);
    p->log = strdup(text);
}

aclError aclrtcCompileProg(void *prog, int num_options, const char **options) {
    struct prog *p = prog;
    char line[1024];
    int n = snprintf(line, sizeof line, "aclrtcCompileProg(%s", p == NULL ? "NULL" : p->name);
    for (int i = 0; i < num_options && n < (int)sizeof line - 2; i++) {
        n += snprintf(line + n, sizeof line - n, ",%s", options[i]);
    }
    snprintf(line + n, sizeof line - n, ")");
    record("%s", line);
    if (p == NULL) return ACL_ERROR_RTC_INVALID_PROG;
    int status = injected("aclrtcCompileProg");
    if (status != 0) {
        const char *(*msg)(void) = recent();
        const char *text = msg == NULL ? NULL : msg();
        set_log(p, text == NULL ? "stand-in: compilation failed" : text);
        return status;
    }
    int arch = 0;
    for (int i = 0; i < num_options; i++) {
        if (strncmp(options[i], "--npu-arch=", 11) == 0 && options[i][11] != '\0') arch = 1;
    }
    if (!arch) {
        set_log(p, "error: no --npu-arch option: the target architecture is required (stand-in)");
        return ACL_ERROR_RTC_INVALID_OPTION;
    }
    static const char *headers[] = {"#include \"prelude.h\"", "#include \"gemm.h\"", "#include \"collective.h\""};
    for (size_t i = 0; i < sizeof headers / sizeof headers[0]; i++) {
        if (strstr(p->src, headers[i]) != NULL) {
            char log[256];
            snprintf(log, sizeof log, "%s.cpp:1:10: fatal error: '%s' file not found (stand-in)", p->name, headers[i] + 10);
            set_log(p, log);
            return ACL_ERROR_RTC_COMPILATION;
        }
    }
    char entry[200];
    snprintf(entry, sizeof entry, "extern \"C\" __global__ __aicore__ void %s(", p->name);
    if (strstr(p->src, entry) == NULL) {
        char log[256];
        snprintf(log, sizeof log, "error: no kernel entry point %s (stand-in)", p->name);
        set_log(p, log);
        return ACL_ERROR_RTC_COMPILATION;
    }
    /* The binary: the marker, every entry point, every option. */
    size_t cap = 64 + strlen(p->src) / 8;
    for (int i = 0; i < num_options; i++) cap += strlen(options[i]) + 16;
    char *bin = malloc(cap);
    size_t len = (size_t)snprintf(bin, cap, "STANDIN-ELF\n");
    const char *marker = "extern \"C\" __global__ __aicore__ void ";
    for (const char *at = strstr(p->src, marker); at != NULL; at = strstr(at + 1, marker)) {
        const char *name = at + strlen(marker);
        size_t name_len = strcspn(name, "(");
        len += (size_t)snprintf(bin + len, cap - len, "kernel %.*s\n", (int)name_len, name);
    }
    for (int i = 0; i < num_options; i++) len += (size_t)snprintf(bin + len, cap - len, "option %s\n", options[i]);
    free(p->bin);
    p->bin = bin;
    p->bin_len = len;
    set_log(p, "");
    return ACL_SUCCESS;
}

aclError aclrtcGetBinDataSize(void *prog, size_t *size) {
    struct prog *p = prog;
    record("aclrtcGetBinDataSize(%s)", p == NULL ? "NULL" : p->name);
    if (p == NULL || size == NULL) return ACL_ERROR_RTC_INVALID_INPUT;
    if (p->bin == NULL) return ACL_ERROR_RTC_INVALID_PROG;
    *size = p->bin_len;
    return ACL_SUCCESS;
}

aclError aclrtcGetBinData(void *prog, char *data) {
    struct prog *p = prog;
    record("aclrtcGetBinData(%s)", p == NULL ? "NULL" : p->name);
    if (p == NULL || data == NULL) return ACL_ERROR_RTC_INVALID_INPUT;
    if (p->bin == NULL) return ACL_ERROR_RTC_INVALID_PROG;
    memcpy(data, p->bin, p->bin_len);
    return ACL_SUCCESS;
}

aclError aclrtcGetCompileLogSize(void *prog, size_t *size) {
    struct prog *p = prog;
    record("aclrtcGetCompileLogSize(%s)", p == NULL ? "NULL" : p->name);
    if (p == NULL || size == NULL) return ACL_ERROR_RTC_INVALID_INPUT;
    *size = p->log == NULL ? 0 : strlen(p->log);
    return ACL_SUCCESS;
}

aclError aclrtcGetCompileLog(void *prog, char *log) {
    struct prog *p = prog;
    record("aclrtcGetCompileLog(%s)", p == NULL ? "NULL" : p->name);
    if (p == NULL || log == NULL) return ACL_ERROR_RTC_INVALID_INPUT;
    if (p->log != NULL) memcpy(log, p->log, strlen(p->log));
    return ACL_SUCCESS;
}

aclError aclrtcDestroyProg(void **prog) {
    struct prog *p = prog == NULL ? NULL : *prog;
    record("aclrtcDestroyProg(%s)", p == NULL ? "NULL" : p->name);
    if (p == NULL) return ACL_ERROR_RTC_INVALID_PROG;
    free(p->src);
    free(p->log);
    free(p->bin);
    free(p);
    *prog = NULL;
    return ACL_SUCCESS;
}
