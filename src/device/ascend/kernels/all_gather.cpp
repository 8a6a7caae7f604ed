// all_gather of column blocks: the Ascend C twin of src/collectives/all_gather.rs.
//
// Every rank holds a row-major [rows, cols_r] block; the result is [rows, sum of cols_r] with
// rank p's block at columns col_offsets[p] (a tensor sharded on any dimension: rows is the
// product of the dimensions before it). Each rank publishes its block, then every program pulls
// chunks grid-stride over tasks flattened across (source, chunk), sources rotated by this rank
// (its own block first, straight from its input).
#include "collective.h"

using namespace dt;

extern "C" __global__ __aicore__ void all_gather(
    GM_ADDR input,    // [rows, cols_me] elem_t
    GM_ADDR output,   // [rows, total_cols] elem_t
    GM_ADDR staging,  // symmetric elem_t: this rank's published input
    GM_ADDR ready,    // symmetric int32 [num_ranks]: programs of each rank that have published
    GM_ADDR table,    // int64: cols[w], col_offsets[w+1], ready_at[w], row_step[w], col_step[w],
                      // tasks[w] (chunks of each rank's block)
    GM_ADDR status,   // int64 [8]: what a wait that timed out saw
    int64_t rank, int64_t num_ranks, int64_t rows, int64_t timeout_cycles)
{
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
    const int64_t me = rank, world = num_ranks;
    const int64_t pid = program_id_vec(), ncore = num_programs();
    __gm__ int64_t *tab = reinterpret_cast<__gm__ int64_t *>(table);
    __gm__ int64_t *cols = tab;
    __gm__ int64_t *col_offsets = tab + world;
    __gm__ int64_t *ready_at = tab + 2 * world + 1;
    __gm__ int64_t *row_step = tab + 3 * world + 1;
    __gm__ int64_t *col_step = tab + 4 * world + 1;
    __gm__ int64_t *tasks = tab + 5 * world + 1;
    __gm__ elem_t *in = reinterpret_cast<__gm__ elem_t *>(input);
    __gm__ elem_t *out = reinterpret_cast<__gm__ elem_t *>(output);
    __gm__ elem_t *stage = reinterpret_cast<__gm__ elem_t *>(staging);
    __gm__ int32_t *signals = reinterpret_cast<__gm__ int32_t *>(ready);
    const int64_t total_cols = col_offsets[world];
    const Status st{reinterpret_cast<__gm__ int64_t *>(status), timeout_cycles};
    AscendC::TPipe pipe;
    AscendC::TBuf<AscendC::TPosition::VECCALC> ub_buf;
    pipe.InitBuffer(ub_buf, UB_TILE_BYTES);
    AscendC::LocalTensor<elem_t> ub = ub_buf.Get<elem_t>();

    if (world > 1) {
        publish_part(stage, in, rows, cols[me], row_step[me], col_step[me], signals, me, world, ub);
    }
    // Tasks flattened over (source, chunk), sources rotated: own block first, then the next ranks.
    const int64_t total = total_rotated(me, world, 0, tasks);
    int64_t held = -1;
    __gm__ elem_t *from = nullptr;
    for (int64_t t = pid; t < total; t += ncore) {
        int64_t within = 0;
        const int64_t src = locate_rotated(t, me, world, 0, tasks, within);
        if (held != src) {
            from = source(stage, in, src, me, signals, ready_at[src], st);
            held = src;
        }
        if (from == nullptr) {
            return;  // the host reads the status record and reports the timeout
        }
        const Chunk c = chunk_at(within, rows, cols[src], row_step[src], col_step[src]);
        copy_2d(out + c.row * total_cols + col_offsets[src] + c.col, total_cols,
                from + c.row * cols[src] + c.col, cols[src], c.rows, c.cols, ub);
    }
}
