// dist-tensor's Ascend C GEMM helpers: the seed's tl.dot on one output tile, through Ascend C's
// high-level Matmul API on the AI core's cube unit (f32 accumulation in L0C, one rounding to the
// output type on the way out), with masks at ragged edges (SetSingleShape with the tile's exact
// extent, never a padded copy).
//
// NOT YET COMPILED BY A REAL aclrtc / bisheng (see prelude.h). The tiling below is written by
// hand, not produced by the host tiling library: its base block sizes are chosen to fit the
// 910B's L0A/L0B (64 KiB each) and L0C (128 KiB) with double buffering, and are the first thing
// to check on hardware.
#pragma once

#include "prelude.h"
#include "lib/matmul_intf.h"

namespace dt {

// Base block of one cube iteration: 128 x 128 outputs, K in steps of 64 (fp16/bf16; f32 halves
// K). L0A: 128 x 64 x 2 B = 16 KiB; L0B: 64 x 128 x 2 B = 16 KiB; L0C: 128 x 128 x 4 B = 64 KiB.
constexpr int32_t GEMM_BASE_M = 128;
constexpr int32_t GEMM_BASE_N = 128;
constexpr int32_t GEMM_BASE_K = sizeof(elem_t) == 4 ? 32 : 64;

// A tiling for products of at most block_m x block_n outputs per call (one output tile per
// IterateAll), over operands of org_m x k (A, row stride k) and k x org_n (B, row stride org_n).
__aicore__ inline void gemm_tiling(TCubeTiling &t, int64_t org_m, int64_t org_n, int64_t k, int64_t block_m,
                                   int64_t block_n) {
    t.usedCoreNum = 1;
    t.M = static_cast<int32_t>(org_m);
    t.N = static_cast<int32_t>(org_n);
    t.Ka = static_cast<int32_t>(k);
    t.Kb = static_cast<int32_t>(k);
    t.singleCoreM = static_cast<int32_t>(block_m);
    t.singleCoreN = static_cast<int32_t>(block_n);
    t.singleCoreK = static_cast<int32_t>(k);
    t.baseM = GEMM_BASE_M;
    t.baseN = GEMM_BASE_N;
    t.baseK = GEMM_BASE_K;
    t.depthA1 = 2;
    t.depthB1 = 2;
    t.stepM = 1;
    t.stepN = 1;
    t.stepKa = 1;
    t.stepKb = 1;
    t.isBias = 0;
    t.iterateOrder = 0;
    t.dbL0A = 2;
    t.dbL0B = 2;
    t.dbL0C = 1;
}

// The seed's tasks_on_sub_vecs for a mix kernel: vector sub-core 0 of every AI core
// communicates, the others compute; with a single sub-core per AI core it does both.
__aicore__ inline int64_t first_compute_sub_vec() { return sub_vec_num_mix() > 1 ? 1 : 0; }

__aicore__ inline int64_t compute_lanes() { return num_programs() * (sub_vec_num_mix() - first_compute_sub_vec()); }

// This sub-core's computing lane, or -1 when it does not compute.
__aicore__ inline int64_t compute_lane() {
    int64_t first = first_compute_sub_vec();
    int64_t sub = sub_vec_id_mix();
    if (sub < first) {
        return -1;
    }
    return program_id_mix() * (sub_vec_num_mix() - first) + (sub - first);
}

}  // namespace dt
