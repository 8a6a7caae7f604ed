// dist-tensor's Ascend C prelude: the seed's primitives (program context, symm_at, notify, wait +
// consume_token, masked tile copies) over Ascend C and Ascend SHMEM's device API.
//
// Every kernel source beside this file includes it first. The crate compiles each kernel with
// aclrtc, pasting this file in place of its #include line, with the options
//   --npu-arch=<the device's, e.g. dav-2201> -DDT_ELEM=<half|bfloat16_t|float> -I<SHMEM include>
// NOT YET COMPILED BY A REAL aclrtc / bisheng: no NPU or CANN was available where this was
// written. The crate's tests compile these sources with the host C++ compiler against a CPU
// implementation of the Ascend C subset they use (tests/cann_stand_in/ascendc_cpu/) and run them
// through World::ascend (tests/ascend_run.rs), and check them against a declared API surface
// (tests/cann_stand_in/ascendc/); neither knows what only the real compiler knows.
#pragma once

#include "kernel_operator.h"
#include "shmem.h"

#ifndef DT_ELEM
#define DT_ELEM float
#endif

namespace dt {

// The element type of this build, and the type products and sums accumulate in.
using elem_t = DT_ELEM;
using acc_t = float;

// ---- program context (the seed's tl.program_id / num_programs / sub_vec_id / sub_vec_num) ----
//
// A mix kernel (KERNEL_TYPE_MIX_AIC_1_2) runs its vector code once per vector sub-core of every
// AI core: GetBlockNum() AI cores, GetSubBlockNum() sub-cores each. A program is an AI core.
// A vector-only kernel runs once per vector core: a program is a vector core, sub-core 0 of 1.
// Core counts come from the launch (the host passes the device's own counts), never constants.

__aicore__ inline int64_t num_programs() { return AscendC::GetBlockNum(); }

__aicore__ inline int64_t sub_vec_num_mix() { return AscendC::GetSubBlockNum(); }

__aicore__ inline int64_t program_id_mix() { return AscendC::GetBlockIdx() / AscendC::GetSubBlockNum(); }

__aicore__ inline int64_t sub_vec_id_mix() { return AscendC::GetSubBlockIdx(); }

__aicore__ inline int64_t program_id_vec() { return AscendC::GetBlockIdx(); }

// The seed's tile::valid_len: how many of `block` items starting at `start` lie below `len` (the
// mask of a ragged edge; never padding).
__aicore__ inline int64_t valid_len(int64_t start, int64_t block, int64_t len) {
    int64_t left = len - start;
    return left <= 0 ? 0 : (left < block ? left : block);
}

__aicore__ inline int64_t ceil_div(int64_t a, int64_t b) { return b == 0 ? 0 : (a + b - 1) / b; }

// Tasks flattened over ranks in an order rotated by `me` (segment i is rank (me + i) % world,
// for i from `first`), rank r holding counts[r] tasks (the host's count): how many there are.
__aicore__ inline int64_t total_rotated(int64_t me, int64_t world, int64_t first, __gm__ int64_t *counts) {
    int64_t total = 0;
    for (int64_t i = first; i < world; ++i) {
        total += counts[(me + i) % world];
    }
    return total;
}

// Which rank flat task `t` of those tasks belongs to, and (in `within`) its index among that
// rank's tasks; -1 past the end.
__aicore__ inline int64_t locate_rotated(int64_t t, int64_t me, int64_t world, int64_t first,
                                         __gm__ int64_t *counts, int64_t &within) {
    int64_t start = 0;
    for (int64_t i = first; i < world; ++i) {
        const int64_t r = (me + i) % world;
        if (t < start + counts[r]) {
            within = t - start;
            return r;
        }
        start += counts[r];
    }
    within = 0;
    return -1;
}

// ---- symmetric memory -------------------------------------------------------------------------

// The seed's symm_at: a peer's copy of a symmetric buffer. Rule 1: it takes the buffer's scalar
// base address, and offsets are added after. Rule 2: symm_at(base, my_rank) is base itself.
template <typename T>
__aicore__ inline __gm__ T *symm_at(__gm__ T *base, int64_t peer) {
    return reinterpret_cast<__gm__ T *>(aclshmem_ptr(reinterpret_cast<__gm__ void *>(base), static_cast<int>(peer)));
}

// ---- signals: notify, wait, consume_token -----------------------------------------------------
//
// A signal is an int32 in symmetric memory that only grows: each call adds to it, and a waiter
// waits until it reaches the cumulative count the host computed (so nothing is ever reset and a
// second call needs no barrier).

// The seed's notify(sig, peer, SignalOp::Add(1), release): once this program's stores are done,
// adds `value` to signal `index` of `peer`.
__aicore__ inline void notify_add(__gm__ int32_t *signals, int64_t index, int64_t peer, int32_t value) {
    AscendC::PipeBarrier<PIPE_ALL>();  // release: the data this signal announces is written
    aclshmemx_signal_op(signals + index, value, ACLSHMEM_SIGNAL_ADD, static_cast<int>(peer));
}

// Counts on this rank's own signal `index` (a local atomic add, not communication): how compute
// sub-cores tell this rank's communication sub-core that a tile is done.
__aicore__ inline void count_local(__gm__ int32_t *signals, int64_t index, int64_t my_rank, int32_t value) {
    AscendC::PipeBarrier<PIPE_ALL>();  // release: the tile this count announces is written
    aclshmemx_signal_op(signals + index, value, ACLSHMEM_SIGNAL_ADD, static_cast<int>(my_rank));
}

// What a wait that timed out leaves for the host, in the rank's status record:
// [0] 1 when set, [1] program, [2] sub-core, [3] signal index, [4] value awaited (>=), [5] value seen.
struct Status {
    __gm__ int64_t *record;
    int64_t timeout_cycles;
};

// A token: proof that a wait succeeded. consume_token(ptr, token) is the only way to the data.
struct Token {
    bool ok;
};

// The seed's wait(sig, >= value, acquire): spins on this rank's own signal `index` until it
// reaches `awaited`, re-reading it past the data cache; gives up after the host's timeout and
// records why (a trap would poison the device context), returning a failed token.
__aicore__ inline Token wait_ge(__gm__ int32_t *signals, int64_t index, int32_t awaited, Status status,
                                int64_t program, int64_t sub_vec) {
    AscendC::GlobalTensor<int32_t> sig;
    sig.SetGlobalBuffer(signals + index, 1);
    int64_t start = AscendC::GetSystemCycle();
    int32_t seen = 0;
    while (true) {
        AscendC::DataCacheCleanAndInvalid<int32_t, AscendC::CacheLine::SINGLE_CACHE_LINE,
                                          AscendC::DcciDst::CACHELINE_OUT>(sig);
        seen = sig.GetValue(0);
        if (seen >= awaited) {
            AscendC::PipeBarrier<PIPE_ALL>();  // acquire: later loads see the announced data
            return Token{true};
        }
        if (AscendC::GetSystemCycle() - start > status.timeout_cycles) {
            break;
        }
    }
    AscendC::GlobalTensor<int64_t> rec;
    rec.SetGlobalBuffer(status.record, 6);
    rec.SetValue(1, program);
    rec.SetValue(2, sub_vec);
    rec.SetValue(3, index);
    rec.SetValue(4, awaited);
    rec.SetValue(5, seen);
    rec.SetValue(0, 1);
    AscendC::DataCacheCleanAndInvalid<int64_t, AscendC::CacheLine::SINGLE_CACHE_LINE,
                                      AscendC::DcciDst::CACHELINE_OUT>(rec);
    return Token{false};
}

// The seed's consume_token: returns `ptr` itself; its use ties the data access to the wait.
template <typename T>
__aicore__ inline __gm__ T *consume_token(__gm__ T *ptr, Token token) {
    (void)token;
    return ptr;
}

// ---- tiles ---------------------------------------------------------------------------------

// Bytes of the unified buffer one tile copy uses. The host cuts blocks so that a chunk's rows,
// each rounded up to the 32-byte granule DataCopyPad lays rows out in, fit (ascend/kernels/mod.rs
// holds the same number, and a test checks that they agree).
constexpr uint32_t UB_TILE_BYTES = 64 * 1024;

// Bytes of the unified buffer the reductions carve into num_ranks + 2 equal slots (one part
// per source rank, the f32 sum, the rounded tile); the host sizes chunks to fit one slot.
constexpr uint32_t UB_REDUCE_BYTES = 160 * 1024;

// A block cut into tasks of whole rows of at most `col_step` columns and at most `row_step` rows
// (the host's TilePlan, same formula): task t covers rows [row, row + rows), columns [col, col + cols).
struct Chunk {
    int64_t row, col, rows, cols;
};

__aicore__ inline int64_t chunk_count(int64_t rows, int64_t cols, int64_t row_step, int64_t col_step) {
    if (rows == 0 || cols == 0) {
        return 0;
    }
    return ceil_div(rows, row_step) * ceil_div(cols, col_step);
}

__aicore__ inline Chunk chunk_at(int64_t t, int64_t rows, int64_t cols, int64_t row_step, int64_t col_step) {
    int64_t per_row = ceil_div(cols, col_step);
    Chunk c;
    c.row = (t / per_row) * row_step;
    c.col = (t % per_row) * col_step;
    c.rows = valid_len(c.row, row_step, rows);
    c.cols = valid_len(c.col, col_step, cols);
    return c;
}

// One piece of a masked copy, GM to GM through the unified buffer: rows x cols that fit it.
template <typename T>
__aicore__ inline void copy_piece(__gm__ T *dst, int64_t dst_stride, __gm__ T *src, int64_t src_stride,
                                  int64_t rows, int64_t cols, AscendC::LocalTensor<T> &ub) {
    AscendC::GlobalTensor<T> from;
    AscendC::GlobalTensor<T> to;
    from.SetGlobalBuffer(src, (rows - 1) * src_stride + cols);
    to.SetGlobalBuffer(dst, (rows - 1) * dst_stride + cols);
    uint32_t row_bytes = static_cast<uint32_t>(cols * sizeof(T));
    AscendC::DataCopyExtParams in{static_cast<uint16_t>(rows), row_bytes,
                                  static_cast<uint32_t>((src_stride - cols) * sizeof(T)), 0, 0};
    AscendC::DataCopyPadExtParams<T> no_pad{false, 0, 0, 0};
    AscendC::DataCopyPad(ub, from, in, no_pad);
    AscendC::SetFlag<AscendC::HardEvent::MTE2_MTE3>(EVENT_ID0);
    AscendC::WaitFlag<AscendC::HardEvent::MTE2_MTE3>(EVENT_ID0);
    AscendC::DataCopyExtParams out{static_cast<uint16_t>(rows), row_bytes, 0,
                                   static_cast<uint32_t>((dst_stride - cols) * sizeof(T)), 0};
    AscendC::DataCopyPad(to, ub, out);
    AscendC::SetFlag<AscendC::HardEvent::MTE3_MTE2>(EVENT_ID0);
    AscendC::WaitFlag<AscendC::HardEvent::MTE3_MTE2>(EVENT_ID0);
}

// The seed's masked tile copy, GM to GM: `rows` x `cols` elements from `src` (row stride
// `src_stride`) to `dst` (row stride `dst_stride`), in pieces that fit the unified buffer. The
// masks are the exact byte lengths of DataCopyPad: nothing outside the block is read or
// written, and nothing is padded (isPad false).
template <typename T>
__aicore__ inline void copy_2d(__gm__ T *dst, int64_t dst_stride, __gm__ T *src, int64_t src_stride,
                               int64_t rows, int64_t cols, AscendC::LocalTensor<T> &ub) {
    const int64_t max_cols = static_cast<int64_t>(UB_TILE_BYTES / sizeof(T));
    const int64_t piece_cols = cols < max_cols ? cols : max_cols;
    const int64_t pitch_bytes = ceil_div(piece_cols * static_cast<int64_t>(sizeof(T)), 32) * 32;
    const int64_t piece_rows = pitch_bytes == 0 ? 1 : static_cast<int64_t>(UB_TILE_BYTES) / pitch_bytes;
    for (int64_t r = 0; r < rows; r += piece_rows) {
        for (int64_t k = 0; k < cols; k += piece_cols) {
            copy_piece(dst + r * dst_stride + k, dst_stride, src + r * src_stride + k, src_stride,
                       valid_len(r, piece_rows, rows), valid_len(k, piece_cols, cols), ub);
        }
    }
}

// A masked tile load into the unified buffer (for reductions): rows x cols from `src`.
template <typename T>
__aicore__ inline void load_2d(AscendC::LocalTensor<T> &ub, __gm__ T *src, int64_t src_stride, int64_t rows,
                               int64_t cols) {
    AscendC::GlobalTensor<T> from;
    from.SetGlobalBuffer(src, (rows - 1) * src_stride + cols);
    AscendC::DataCopyExtParams in{static_cast<uint16_t>(rows), static_cast<uint32_t>(cols * sizeof(T)),
                                  static_cast<uint32_t>((src_stride - cols) * sizeof(T)), 0, 0};
    AscendC::DataCopyPadExtParams<T> no_pad{false, 0, 0, 0};
    AscendC::DataCopyPad(ub, from, in, no_pad);
}

// A masked tile store from the unified buffer: rows x cols to `dst`.
template <typename T>
__aicore__ inline void store_2d(__gm__ T *dst, int64_t dst_stride, AscendC::LocalTensor<T> &ub, int64_t rows,
                                int64_t cols) {
    AscendC::GlobalTensor<T> to;
    to.SetGlobalBuffer(dst, (rows - 1) * dst_stride + cols);
    AscendC::DataCopyExtParams out{static_cast<uint16_t>(rows), static_cast<uint32_t>(cols * sizeof(T)), 0,
                                   static_cast<uint32_t>((dst_stride - cols) * sizeof(T)), 0};
    AscendC::DataCopyPad(to, ub, out);
}

// Elements per row DataCopyPad lays a tile of `cols` elements of T out with in the unified
// buffer: rows start on 32-byte granules.
template <typename T>
__aicore__ inline int64_t ub_pitch(int64_t cols) {
    return ceil_div(cols * static_cast<int64_t>(sizeof(T)), 32) * 32 / static_cast<int64_t>(sizeof(T));
}

// acc (f32, f32 pitch) = part (or acc + part when `add`), part being `rows` x `cols` of elem_t in
// its own pitch; `row_tmp` holds one f32 row. f32 inputs add the whole tile at once; half types
// are widened row by row (their pitch differs from the f32 one).
__aicore__ inline void widen_add(AscendC::LocalTensor<acc_t> &acc, AscendC::LocalTensor<elem_t> &part,
                                 AscendC::LocalTensor<acc_t> &row_tmp, int64_t rows, int64_t cols, bool add) {
    const int64_t acc_pitch = ub_pitch<acc_t>(cols);
    if (sizeof(elem_t) == sizeof(acc_t)) {
        AscendC::LocalTensor<acc_t> same = part.template ReinterpretCast<acc_t>();
        if (add) {
            AscendC::Add(acc, acc, same, static_cast<int32_t>(rows * acc_pitch));
        } else {
            AscendC::Adds(acc, same, 0.0f, static_cast<int32_t>(rows * acc_pitch));
        }
        AscendC::PipeBarrier<PIPE_V>();
        return;
    }
    const int64_t pitch = ub_pitch<elem_t>(cols);
    for (int64_t r = 0; r < rows; ++r) {
        AscendC::LocalTensor<acc_t> acc_row = acc[r * acc_pitch];
        AscendC::LocalTensor<elem_t> part_row = part[r * pitch];
        if (add) {
            AscendC::Cast(row_tmp, part_row, AscendC::RoundMode::CAST_NONE, static_cast<int32_t>(cols));
            AscendC::PipeBarrier<PIPE_V>();
            AscendC::Add(acc_row, acc_row, row_tmp, static_cast<int32_t>(cols));
        } else {
            AscendC::Cast(acc_row, part_row, AscendC::RoundMode::CAST_NONE, static_cast<int32_t>(cols));
        }
        AscendC::PipeBarrier<PIPE_V>();
    }
}

// Rounds an f32 tile (f32 pitch) once into `out` (elem_t pitch) and stores it, masked, at `dst`.
__aicore__ inline void round_store(__gm__ elem_t *dst, int64_t dst_stride, AscendC::LocalTensor<acc_t> &acc,
                                   AscendC::LocalTensor<elem_t> &out, int64_t rows, int64_t cols) {
    if (sizeof(elem_t) == sizeof(acc_t)) {
        AscendC::SetFlag<AscendC::HardEvent::V_MTE3>(EVENT_ID0);
        AscendC::WaitFlag<AscendC::HardEvent::V_MTE3>(EVENT_ID0);
        AscendC::LocalTensor<elem_t> same = acc.template ReinterpretCast<elem_t>();
        store_2d(dst, dst_stride, same, rows, cols);
    } else {
        const int64_t acc_pitch = ub_pitch<acc_t>(cols), pitch = ub_pitch<elem_t>(cols);
        for (int64_t r = 0; r < rows; ++r) {
            AscendC::LocalTensor<elem_t> out_row = out[r * pitch];
            AscendC::LocalTensor<acc_t> acc_row = acc[r * acc_pitch];
            AscendC::Cast(out_row, acc_row, AscendC::RoundMode::CAST_RINT, static_cast<int32_t>(cols));
        }
        AscendC::SetFlag<AscendC::HardEvent::V_MTE3>(EVENT_ID0);
        AscendC::WaitFlag<AscendC::HardEvent::V_MTE3>(EVENT_ID0);
        store_2d(dst, dst_stride, out, rows, cols);
    }
    AscendC::SetFlag<AscendC::HardEvent::MTE3_MTE2>(EVENT_ID0);
    AscendC::WaitFlag<AscendC::HardEvent::MTE3_MTE2>(EVENT_ID0);
}

}  // namespace dt
