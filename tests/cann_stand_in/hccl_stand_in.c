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
 * HcclGetRootInfo writes a recognisable text into the root info; every other call answers
 * with a parameter error, since the stand-in has no communicator to offer.
 */

#include <stdint.h>
#include <stdio.h>
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

HcclResult HcclCommDestroy(void *comm) {
    (void)comm;
    return HCCL_E_PARA;
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
