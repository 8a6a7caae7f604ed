// reduce_scatter of column blocks: the Ascend C twin of src/collectives/reduce_scatter.rs.
//
// Every rank holds [rows, total]; rank r gets [rows, counts[r]], the sum over ranks of the
// columns col_offsets[r] .. + counts[r] (or their mean). Each rank publishes its whole input;
// then every program, grid-stride over chunks of this rank's block, loads the chunk from every
// rank in rotated order (so ranks do not all read the same peer at once) and adds the parts in
// rank order 0, 1, 2, ... in f32, rounding once: the same bits on every run.
#include "collective.h"

using namespace dt;

extern "C" __global__ __aicore__ void reduce_scatter(
    GM_ADDR input,    // [rows, total] elem_t
    GM_ADDR output,   // [rows, counts[me]] elem_t
    GM_ADDR staging,  // symmetric elem_t: this rank's published input
    GM_ADDR ready,    // symmetric int32 [num_ranks]: programs of each rank that have published
    GM_ADDR table,    // int64: counts[w], col_offsets[w+1], ready_at[w]
    GM_ADDR status,   // int64 [8]: what a wait that timed out saw
    int64_t rank, int64_t num_ranks, int64_t rows, int64_t mean,
    int64_t publish_row_step, int64_t publish_col_step,  // the publish chunks (host TilePlan)
    int64_t row_step, int64_t col_step,                  // the reduction chunks (host TilePlan)
    int64_t slot_bytes,                                  // one UB slot: UB_REDUCE_BYTES / (w + 2)
    int64_t timeout_cycles)
{
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
    const int64_t me = rank, world = num_ranks;
    const int64_t pid = program_id_vec(), ncore = num_programs();
    __gm__ int64_t *tab = reinterpret_cast<__gm__ int64_t *>(table);
    __gm__ int64_t *counts = tab;
    __gm__ int64_t *col_offsets = tab + world;
    __gm__ int64_t *ready_at = tab + 2 * world + 1;
    __gm__ elem_t *in = reinterpret_cast<__gm__ elem_t *>(input);
    __gm__ elem_t *out = reinterpret_cast<__gm__ elem_t *>(output);
    __gm__ elem_t *stage = reinterpret_cast<__gm__ elem_t *>(staging);
    __gm__ int32_t *signals = reinterpret_cast<__gm__ int32_t *>(ready);
    const int64_t total = col_offsets[world], mine = counts[me];
    const Status st{reinterpret_cast<__gm__ int64_t *>(status), timeout_cycles};
    AscendC::TPipe pipe;
    AscendC::TBuf<AscendC::TPosition::VECCALC> ub_buf;
    pipe.InitBuffer(ub_buf, UB_REDUCE_BYTES);
    // Slots: parts 0 .. world - 1, then the f32 sum, then the rounded tile.
    AscendC::LocalTensor<uint8_t> ub_bytes = ub_buf.Get<uint8_t>();
    AscendC::LocalTensor<acc_t> acc = ub_bytes[world * slot_bytes].ReinterpretCast<acc_t>();
    AscendC::LocalTensor<elem_t> rounded = ub_bytes[(world + 1) * slot_bytes].ReinterpretCast<elem_t>();

    if (world > 1) {
        AscendC::LocalTensor<elem_t> copy_ub = ub_bytes.ReinterpretCast<elem_t>();
        publish_part(stage, in, rows, total, publish_row_step, publish_col_step, signals, me, world, copy_ub);
        AscendC::PipeBarrier<PIPE_ALL>();  // the publish tiles are done with the buffer
    }
    const int64_t chunks = chunk_count(rows, mine, row_step, col_step);
    for (int64_t t = pid; t < chunks; t += ncore) {
        const Chunk c = chunk_at(t, rows, mine, row_step, col_step);
        const int64_t at = c.row * total + col_offsets[me] + c.col;
        // Load in rotated order...
        for (int64_t i = 0; i < world; ++i) {
            const int64_t src = (me + i) % world;
            __gm__ elem_t *from = source(stage, in, src, me, signals, ready_at[src], st);
            if (from == nullptr) {
                return;  // the host reads the status record and reports the timeout
            }
            AscendC::LocalTensor<elem_t> part = ub_bytes[src * slot_bytes].ReinterpretCast<elem_t>();
            load_2d(part, from + at, total, c.rows, c.cols);
        }
        AscendC::SetFlag<AscendC::HardEvent::MTE2_V>(EVENT_ID0);
        AscendC::WaitFlag<AscendC::HardEvent::MTE2_V>(EVENT_ID0);
        // ...and add in rank order, so every run gives the same bits.
        for (int64_t src = 0; src < world; ++src) {
            AscendC::LocalTensor<elem_t> part = ub_bytes[src * slot_bytes].ReinterpretCast<elem_t>();
            AscendC::LocalTensor<acc_t> row_tmp = rounded.ReinterpretCast<acc_t>();
            widen_add(acc, part, row_tmp, c.rows, c.cols, src > 0);
        }
        if (mean != 0) {
            AscendC::Muls(acc, acc, 1.0f / static_cast<float>(world),
                          static_cast<int32_t>(c.rows * ub_pitch<acc_t>(c.cols)));
            AscendC::PipeBarrier<PIPE_V>();
        }
        round_store(out + c.row * mine + c.col, mine, acc, rounded, c.rows, c.cols);
    }
}
