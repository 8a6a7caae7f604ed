// TEST STAND-IN, NOT ASCEND SHMEM: the device calls of Ascend SHMEM the kernels use, on the CPU
// (see kernel_operator.h beside this file). Every PE's symmetric heap is host memory that every
// rank's threads reach; the heaps come with the launch, from the SHMEM stand-in through the
// AscendCL stand-in.
#pragma once

#include "kernel_operator.h"

enum aclshmem_signal_op_type_t { ACLSHMEM_SIGNAL_SET, ACLSHMEM_SIGNAL_ADD };

// PE `pe`'s address of `ptr`, an address in this PE's heap (internal linkage: the host
// library's symbol of the same name is another function).
static inline __gm__ void *aclshmem_ptr(__gm__ void *ptr, int pe) {
    standin::check_abort();
    const standin_launch_info *info = standin::core().launch->info;
    const int me = info->my_pe;
    if (me < 0 || pe < 0 || pe >= info->n_pes || info->heaps[pe].base == nullptr) {
        char text[160];
        snprintf(text, sizeof text, "aclshmem_ptr to PE %d, which is not a PE of this job (%d PEs, this one %d)", pe,
                 info->n_pes, me);
        standin::fault(text);
    }
    standin::Core &c = standin::core();
    if (pe != me && c.kind == standin::Kind::AIV && c.block_idx == 0 && c.launch->info->first_remote_pe < 0) {
        // Only this core writes it, and the launch reads it after joining every core.
        const_cast<standin_launch_info *>(c.launch->info)->first_remote_pe = pe;
    }
    uint8_t *p = static_cast<uint8_t *>(ptr);
    uint8_t *base = static_cast<uint8_t *>(info->heaps[me].base);
    if (p < base || p >= base + info->heaps[me].size) {
        standin::fault("aclshmem_ptr of an address outside this PE's symmetric heap");
    }
    return static_cast<uint8_t *>(info->heaps[pe].base) + (p - base);
}

// Adds `signal` to (or sets) the int32 at `sig_addr` on PE `pe`, after this core's earlier
// stores (release); atomic, so concurrent adds from every rank all count.
static inline void aclshmemx_signal_op(__gm__ int32_t *sig_addr, int32_t signal, int sig_op, int pe) {
    standin::check_abort();
    const int me = standin::core().launch->info->my_pe;
    if (pe != me) {
        standin::need_comm_core("a SHMEM signal", pe);
    }
    int32_t *target = static_cast<int32_t *>(aclshmem_ptr(sig_addr, pe));
    standin::gm_check(target, 4, "aclshmemx_signal_op");
    if (sig_op == ACLSHMEM_SIGNAL_ADD) {
        __atomic_fetch_add(target, signal, __ATOMIC_RELEASE);
    } else {
        __atomic_store_n(target, signal, __ATOMIC_RELEASE);
    }
}
