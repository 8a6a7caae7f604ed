/*
 * TEST STAND-IN FOR HCCL (libhccl.so / libhcomm.so). NOT HCCL, NO COLLECTIVES, NO NPU.
 *
 * Used only by dist-tensor's tests/ascend_*.rs, which compile it into a temporary directory
 * under target/ to check how dist_tensor::device::ascend finds HCCL's symbols. Nothing else
 * builds, ships or loads it.
 *
 * Two builds, as newer CANN splits HCCL:
 *   (no define)            libhccl.so: the collective library, here only a marker symbol;
 *                          the communicator calls are NOT in it
 *   -DSTANDIN_COMM_CALLS   libhcomm.so: the communicator calls (HcclGetRootInfo,
 *                          HcclCommInitRootInfo, HcclCommDestroy, HcclGetRankSize) and
 *                          HcclGetErrorString, with the signatures of CANN's hccl.h /
 *                          hccl_comm.h
 *
 * HcclGetRootInfo writes a recognisable text into the root info. HcclCommInitAll makes one
 * communicator per device of the process (a handle naming its rank and the world's size);
 * HcclGetCommName names it; HcclAllGatherV and HcclReduceScatterV record their arguments and
 * move nothing; HcclCommDestroy frees a communicator HcclCommInitAll made. Other calls
 * (HcclCommInitRootInfo, HcclGetRankSize) answer with a parameter error. Calls are recorded in
 * the AscendCL stand-in's log when it is loaded (found with dlsym), and fail as it was told to
 * (standin_fail).
 */

#include "stand_in_log.h"
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int HcclResult;

#define HCCL_SUCCESS 0
#define HCCL_E_PARA 1
#define HCCL_ROOT_INFO_BYTES 4108

typedef struct {
    char internal[HCCL_ROOT_INFO_BYTES];
} HcclRootInfo;

#ifdef STANDIN_COMM_CALLS

const char *standin_hccl_part(void) { return "hcomm"; }

HcclResult HcclGetRootInfo(HcclRootInfo *root_info) {
    if (root_info == NULL) return HCCL_E_PARA;
    memset(root_info->internal, 0, sizeof root_info->internal);
    snprintf(root_info->internal, sizeof root_info->internal, "%s", "dist-tensor hccl stand-in root");
    return HCCL_SUCCESS;
}

HcclResult HcclCommInitRootInfo(uint32_t n_ranks, const HcclRootInfo *root_info, uint32_t rank,
                                void **comm) {
    (void)n_ranks;
    (void)root_info;
    (void)rank;
    (void)comm;
    return HCCL_E_PARA;
}

struct comm {
    char magic[8];
    uint32_t rank;
    uint32_t n_ranks;
    int32_t device;
};

static struct comm *as_comm(void *handle) {
    struct comm *c = handle;
    return c != NULL && memcmp(c->magic, "STANDIN", 8) == 0 ? c : NULL;
}

HcclResult HcclCommInitAll(uint32_t ndev, int32_t *devices, void **comms) {
    record("HcclCommInitAll(%u devices)", ndev);
    int status = injected("HcclCommInitAll");
    if (status != 0) return status;
    if (ndev == 0 || devices == NULL || comms == NULL) return HCCL_E_PARA;
    for (uint32_t r = 0; r < ndev; r++) {
        struct comm *c = calloc(1, sizeof *c);
        memcpy(c->magic, "STANDIN", 8);
        c->rank = r;
        c->n_ranks = ndev;
        c->device = devices[r];
        comms[r] = c;
    }
    return HCCL_SUCCESS;
}

HcclResult HcclGetCommName(void *handle, char *name) {
    struct comm *c = as_comm(handle);
    if (c == NULL || name == NULL) return HCCL_E_PARA;
    snprintf(name, 128, "standin_comm_%u_ranks", c->n_ranks);
    return HCCL_SUCCESS;
}

/* What a collective `call` on the communicator `c` answers: the injected failure, else a parameter
 * error for a handle that is not a communicator. */
static HcclResult answer(const char *call, const struct comm *c) {
    int status = injected(call);
    if (status != 0) return status;
    return c == NULL ? HCCL_E_PARA : HCCL_SUCCESS;
}

HcclResult HcclAllGatherV(void *send, uint64_t send_count, void *recv, const void *recv_counts,
                          const void *recv_displs, int data_type, void *handle, void *stream) {
    struct comm *c = as_comm(handle);
    const uint64_t *counts = recv_counts;
    record("HcclAllGatherV(rank=%d,send=%llu,type=%d,count0=%llu)", c == NULL ? -1 : (int)c->rank,
           (unsigned long long)send_count, data_type, counts == NULL ? 0ULL : (unsigned long long)counts[0]);
    (void)send;
    (void)recv;
    (void)recv_displs;
    (void)stream;
    return answer("HcclAllGatherV", c);
}

HcclResult HcclReduceScatterV(void *send, const void *send_counts, const void *send_displs, void *recv,
                              uint64_t recv_count, int data_type, int op, void *handle, void *stream) {
    struct comm *c = as_comm(handle);
    record("HcclReduceScatterV(rank=%d,recv=%llu,type=%d,op=%d)", c == NULL ? -1 : (int)c->rank,
           (unsigned long long)recv_count, data_type, op);
    (void)send;
    (void)send_counts;
    (void)send_displs;
    (void)recv;
    (void)stream;
    return answer("HcclReduceScatterV", c);
}

HcclResult HcclCommDestroy(void *handle) {
    struct comm *c = as_comm(handle);
    record("HcclCommDestroy(rank=%d)", c == NULL ? -1 : (int)c->rank);
    if (c == NULL) return HCCL_E_PARA;
    memset(c->magic, 0, sizeof c->magic);
    free(c);
    return HCCL_SUCCESS;
}

HcclResult HcclGetRankSize(void *comm, uint32_t *rank_size) {
    (void)comm;
    (void)rank_size;
    return HCCL_E_PARA;
}

const char *HcclGetErrorString(HcclResult code) {
    switch (code) {
    case HCCL_SUCCESS: return "no error (stand-in)";
    case HCCL_E_PARA: return "parameter error (stand-in)";
    default: return "unknown error (stand-in)";
    }
}

#else

const char *standin_hccl_part(void) { return "hccl"; }

#endif
