/*
 * TEST STAND-IN, NOT CANN: what the executing AscendCL stand-in (acl_stand_in.c, built with
 * -DSTANDIN_EXECUTE) hands a kernel launch of the CPU implementation of Ascend C
 * (ascendc_cpu/kernel_operator.h): a PE's symmetric heap, and the launch. Declared once, in C,
 * for both.
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct standin_heap {
    void *base;
    size_t size;
};

struct standin_launch_info {
    const char *kernel;
    void *fn;
    uint32_t blocks;
    int mix;
    int sub_vec_num;
    const int64_t *args;
    int nargs;
    int my_pe;
    int n_pes;
    const struct standin_heap *heaps;
    int (*gm_valid)(const void *p, size_t len);
    uint64_t ub_bytes;
    char *error;
    size_t error_len;
    int first_remote_pe; /* out: the first peer the core of block index 0 reached (-1: none) */
};

#ifdef __cplusplus
}
#endif
