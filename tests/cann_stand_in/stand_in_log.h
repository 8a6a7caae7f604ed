/*
 * TEST STAND-IN HELPERS, shared by the stand-ins that log into the AscendCL stand-in: its
 * exported controls are found with dlsym(RTLD_DEFAULT), since the crate opens it with
 * RTLD_GLOBAL before any other library.
 */
#ifndef DIST_TENSOR_STAND_IN_LOG_H
#define DIST_TENSOR_STAND_IN_LOG_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>

/* Appends one line to the shared log. */
__attribute__((unused)) static void record(const char *fmt, ...) {
    char line[1024];
    va_list args;
    va_start(args, fmt);
    vsnprintf(line, sizeof line, fmt, args);
    va_end(args);
    void (*sink)(const char *) = (void (*)(const char *))dlsym(RTLD_DEFAULT, "standin_record_line");
    if (sink != NULL) sink(line);
}

/* The status standin_fail set for `call` (0: none); its message is then what
 * aclGetRecentErrMsg gives. */
__attribute__((unused)) static int injected(const char *call) {
    int (*status)(const char *) = (int (*)(const char *))dlsym(RTLD_DEFAULT, "standin_injected_status");
    return status == NULL ? 0 : status(call);
}

#endif
