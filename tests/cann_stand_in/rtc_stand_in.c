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
 * Built with -DSTANDIN_EXECUTE (and STANDIN_ASCENDC_DIR, STANDIN_CACHE_DIR: string literals), it
 * compiles for real: the source, with the -D and -std options the crate passes (--npu-arch and
 * -I are the NPU's and are dropped), goes through the host C++ compiler ($CXX, or c++) against
 * the CPU implementation of Ascend C in STANDIN_ASCENDC_DIR, into a shared object, kept in
 * STANDIN_CACHE_DIR under a hash of the source, the options and that implementation (so each
 * kernel is compiled once per change, not once per test). A compiler error is a failed
 * compilation whose log is the compiler's. The binary is the text header above, a "mix <name>"
 * line for every entry point declaring KERNEL_TYPE_MIX_AIC_1_2 (the launch mode a real binary
 * records), then "shared-object-follows" and the shared object.
 *
 * Test controls (for negative controls: a mutated copy of a kernel, compiled and run through the
 * crate's real path):
 *   standin_rtc_mutate(kernel, from, to)   compile `kernel` with every `from` replaced by `to`
 *                                          (a compile error, with a log saying so, when the
 *                                          source has no `from`: a mutation that does not apply
 *                                          must not pass as one that was caught)
 *   standin_rtc_clear_mutations()
 *
 * Every call is recorded in the AscendCL stand-in's log (found with dlsym).
 */

#include "stand_in_log.h"
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>

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

#ifdef STANDIN_EXECUTE
#include <sys/stat.h>
#include <unistd.h>

static uint64_t fnv(uint64_t h, const void *data, size_t len) {
    const unsigned char *b = data;
    for (size_t i = 0; i < len; i++) {
        h ^= b[i];
        h *= 1099511628211ull;
    }
    return h;
}

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *data = malloc((size_t)n + 1);
    size_t got = fread(data, 1, (size_t)n, f);
    fclose(f);
    data[got] = '\0';
    *len = got;
    return data;
}

/* The kernel as a shared object for the CPU (from the cache, or compiled now); NULL with the
 * compiler's log set on failure. */
static char *compile_for_cpu(struct prog *p, int num_options, const char **options, size_t *so_len) {
    /* The headers the kernel compiles against, the shared ones beside the directory included. */
    static const char *parts[] = {"/kernel_operator.h", "/shmem.h", "/lib/matmul_intf.h",
                                  "/../ascendc_types.h", "/../ascendc_matmul_type.h",
                                  "/../standin_launch_info.h"};
    uint64_t h = fnv(1469598103934665603ull, p->src, strlen(p->src));
    char flags[2048] = "";
    size_t used = 0;
    for (int i = 0; i < num_options; i++) {
        if (strncmp(options[i], "-D", 2) == 0 || strncmp(options[i], "-std=", 5) == 0) {
            /* Options are the crate's own (-DDT_ELEM=half, -std=c++17): no shell quoting needed,
             * but refuse anything that would need it. */
            if (strpbrk(options[i], " '\"$`\\;&|<>") != NULL) {
                set_log(p, "stand-in: an option with shell characters");
                return NULL;
            }
            used += (size_t)snprintf(flags + used, sizeof flags - used, " '%s'", options[i]);
            h = fnv(h, options[i], strlen(options[i]) + 1);
        }
    }
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s%s", STANDIN_ASCENDC_DIR, parts[i]);
        size_t n = 0;
        char *text = read_file(path, &n);
        if (text != NULL) {
            h = fnv(h, text, n);
            free(text);
        }
    }
    mkdir(STANDIN_CACHE_DIR, 0755);
    char so_path[1024], src_path[1024], tmp_path[1100], log_path[1100];
    snprintf(so_path, sizeof so_path, "%s/%s-%016llx.so", STANDIN_CACHE_DIR, p->name, (unsigned long long)h);
    char *so = read_file(so_path, so_len);
    if (so != NULL) return so;
    snprintf(src_path, sizeof src_path, "%s/%s-%016llx.cpp", STANDIN_CACHE_DIR, p->name, (unsigned long long)h);
    snprintf(tmp_path, sizeof tmp_path, "%s.%d.tmp", so_path, (int)getpid());
    snprintf(log_path, sizeof log_path, "%s.%d.log", so_path, (int)getpid());
    FILE *f = fopen(src_path, "wb");
    if (f == NULL) {
        set_log(p, "stand-in: cannot write the kernel source to the cache directory");
        return NULL;
    }
    fputs(p->src, f);
    fclose(f);
    const char *cxx = getenv("CXX");
    char command[4096];
    snprintf(command, sizeof command,
             "'%s' -O1 -g0 -shared -fPIC -pthread -fvisibility=hidden -I'%s' %s -o '%s' '%s' > '%s' 2>&1",
             cxx != NULL && cxx[0] != '\0' ? cxx : "c++", STANDIN_ASCENDC_DIR, flags, tmp_path, src_path, log_path);
    int rc = system(command);
    size_t log_len = 0;
    char *log = read_file(log_path, &log_len);
    unlink(log_path);
    if (rc != 0) {
        set_log(p, log != NULL && log_len > 0 ? log : "stand-in: the host C++ compiler failed with no output");
        free(log);
        unlink(tmp_path);
        return NULL;
    }
    free(log);
    rename(tmp_path, so_path);
    so = read_file(so_path, so_len);
    if (so == NULL) set_log(p, "stand-in: the compiled kernel is missing");
    return so;
}
#endif

#define MAX_MUTATIONS 8
struct mutation { char kernel[64]; char *from; char *to; };
static struct mutation g_mutations[MAX_MUTATIONS];
static int g_mutation_count;

void standin_rtc_clear_mutations(void) {
    for (int i = 0; i < g_mutation_count; i++) {
        free(g_mutations[i].from);
        free(g_mutations[i].to);
    }
    g_mutation_count = 0;
}

void standin_rtc_mutate(const char *kernel, const char *from, const char *to) {
    if (g_mutation_count == MAX_MUTATIONS || from[0] == '\0') return;
    struct mutation *m = &g_mutations[g_mutation_count++];
    snprintf(m->kernel, sizeof m->kernel, "%s", kernel);
    m->from = strdup(from);
    m->to = strdup(to);
}

/* `src` with every `from` replaced by `to` (a new string); *found says whether any was. */
static char *replace_all(const char *src, const char *from, const char *to, int *found) {
    size_t from_len = strlen(from), to_len = strlen(to), count = 0;
    for (const char *at = strstr(src, from); at != NULL; at = strstr(at + from_len, from)) count++;
    *found = count > 0;
    char *out = malloc(strlen(src) + count * (to_len + 1) + 1);
    char *w = out;
    const char *r = src;
    for (const char *at = strstr(r, from); at != NULL; at = strstr(r, from)) {
        memcpy(w, r, (size_t)(at - r));
        w += at - r;
        memcpy(w, to, to_len);
        w += to_len;
        r = at + from_len;
    }
    strcpy(w, r);
    return out;
}

/* Applies the mutations for `p`; 0 with the log set when one does not apply. */
static int apply_mutations(struct prog *p) {
    for (int i = 0; i < g_mutation_count; i++) {
        if (strcmp(g_mutations[i].kernel, p->name) != 0) continue;
        int found = 0;
        char *mutated = replace_all(p->src, g_mutations[i].from, g_mutations[i].to, &found);
        if (!found) {
            free(mutated);
            char log[512];
            snprintf(log, sizeof log, "stand-in mutation: `%.200s` is not in %s's source", g_mutations[i].from, p->name);
            set_log(p, log);
            return 0;
        }
        free(p->src);
        p->src = mutated;
    }
    return 1;
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
    if (!apply_mutations(p)) return ACL_ERROR_RTC_COMPILATION;
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
#ifdef STANDIN_EXECUTE
    size_t so_len = 0;
    char *so = compile_for_cpu(p, num_options, options, &so_len);
    if (so == NULL) return ACL_ERROR_RTC_COMPILATION;
#endif
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
#ifdef STANDIN_EXECUTE
    if (strstr(p->src, "KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2)") != NULL) {
        bin = realloc(bin, cap + 160);
        len += (size_t)snprintf(bin + len, cap + 160 - len, "mix %s\n", p->name);
    }
    static const char so_marker[] = "shared-object-follows\n";
    bin = realloc(bin, len + sizeof so_marker + so_len);
    memcpy(bin + len, so_marker, sizeof so_marker - 1);
    len += sizeof so_marker - 1;
    memcpy(bin + len, so, so_len);
    len += so_len;
    free(so);
#endif
    free(p->bin);
    p->bin = bin;
    p->bin_len = len;
    set_log(p, "");
    return ACL_SUCCESS;
}

/* Whether `call` (recorded) may read the binary of `p` into `out`: both given, `p` compiled. */
static aclError bin_readable(const char *call, const struct prog *p, const void *out) {
    record("%s(%s)", call, p == NULL ? "NULL" : p->name);
    if (p == NULL || out == NULL) return ACL_ERROR_RTC_INVALID_INPUT;
    if (p->bin == NULL) return ACL_ERROR_RTC_INVALID_PROG;
    return ACL_SUCCESS;
}

aclError aclrtcGetBinDataSize(void *prog, size_t *size) {
    struct prog *p = prog;
    aclError status = bin_readable("aclrtcGetBinDataSize", p, size);
    if (status != ACL_SUCCESS) return status;
    *size = p->bin_len;
    return ACL_SUCCESS;
}

aclError aclrtcGetBinData(void *prog, char *data) {
    struct prog *p = prog;
    aclError status = bin_readable("aclrtcGetBinData", p, data);
    if (status != ACL_SUCCESS) return status;
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
