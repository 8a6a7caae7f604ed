// TEST SURFACE, NOT ASCEND SHMEM: the subset of Ascend SHMEM's device API (`shmem.h`, from its
// include/device headers) the kernels use. See kernel_operator.h beside this file.
#pragma once

#include "kernel_operator.h"

enum aclshmem_signal_op_type_t { ACLSHMEM_SIGNAL_SET, ACLSHMEM_SIGNAL_ADD };

__gm__ void *aclshmem_ptr(__gm__ void *ptr, int pe);
void aclshmemx_signal_op(__gm__ int32_t *sig_addr, int32_t signal, int sig_op, int pe);
