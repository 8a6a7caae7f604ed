// TEST SURFACE, NOT ASCEND C: the plain types of Ascend C's device API that the declared surface
// (ascendc/kernel_operator.h) and its CPU implementation (ascendc_cpu/kernel_operator.h) declare
// alike, written once and included by both: the qualifiers, the element and enum types, the
// Matmul tiling and the DataCopyPad parameters, as the Ascend C API reference (CANN 8.3) declares
// them. (`__global__` differs: the CPU implementation exports the kernel.)
#pragma once

#include <cstdint>

#define __aicore__
#define __gm__
#define GM_ADDR uint8_t *

using half = _Float16;

// bfloat16: the upper half of an f32 (in the CPU implementation, rounded to nearest even on the
// way in).
struct bfloat16_t {
    uint16_t bits;
};

enum KernelType { KERNEL_TYPE_AIV_ONLY, KERNEL_TYPE_AIC_ONLY, KERNEL_TYPE_MIX_AIC_1_2 };
enum pipe_t { PIPE_S, PIPE_V, PIPE_M, PIPE_MTE1, PIPE_MTE2, PIPE_MTE3, PIPE_FIX, PIPE_ALL };

enum class CubeFormat { ND, NZ };

struct TCubeTiling {
    int32_t usedCoreNum, M, N, Ka, Kb, singleCoreM, singleCoreN, singleCoreK, baseM, baseN, baseK;
    int32_t depthA1, depthB1, stepM, stepN, isBias, transLength, iterateOrder, shareMode;
    int32_t shareL1Size, shareL0CSize, shareUbSize, batchM, batchN, singleBatchM, singleBatchN;
    int32_t stepKa, stepKb, depthAL1CacheUB, depthBL1CacheUB, dbL0A, dbL0B, dbL0C;
};

namespace AscendC {

struct DataCopyExtParams {
    uint16_t blockCount;
    uint32_t blockLen;
    uint32_t srcStride;
    uint32_t dstStride;
    uint32_t rsv;
};

template <typename T>
struct DataCopyPadExtParams {
    bool isPad;
    uint8_t leftPadding;
    uint8_t rightPadding;
    T paddingValue;
};

}  // namespace AscendC
