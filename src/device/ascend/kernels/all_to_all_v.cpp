// all_to_all with uneven counts: the Ascend C twin of src/collectives/all_to_all.rs.
//
// Rank p sends send_counts[p][q] elements to rank q, from consecutive ranges of its input in
// rank order; each rank's output is what it receives, in source order. Each rank publishes its
// whole input; every program then pulls the pieces meant for this rank, grid-stride over tasks
// flattened across (source, chunk), sources rotated by this rank (its own piece first).
#include "collective.h"

using namespace dt;

extern "C" __global__ __aicore__ void all_to_all_v(
    GM_ADDR input,    // [in_len] elem_t
    GM_ADDR output,   // [sum of recv] elem_t
    GM_ADDR staging,  // symmetric elem_t: this rank's published input
    GM_ADDR ready,    // symmetric int32 [num_ranks]: programs of each rank that have published
    GM_ADDR table,    // int64: recv[w] (elements from each source), send_start[w] (where they
                      // start in the source's input), recv_offsets[w+1], ready_at[w], col_step[w],
                      // tasks[w] (chunks of each source's piece)
    GM_ADDR status,   // int64 [8]: what a wait that timed out saw
    int64_t rank, int64_t num_ranks, int64_t in_len,
    int64_t publish_col_step,  // the publish chunks (host TilePlan over one row of in_len)
    int64_t timeout_cycles)
{
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
    const int64_t me = rank, world = num_ranks;
    const int64_t pid = program_id_vec(), ncore = num_programs();
    __gm__ int64_t *tab = reinterpret_cast<__gm__ int64_t *>(table);
    __gm__ int64_t *recv = tab;
    __gm__ int64_t *send_start = tab + world;
    __gm__ int64_t *recv_offsets = tab + 2 * world;
    __gm__ int64_t *ready_at = tab + 3 * world + 1;
    __gm__ int64_t *col_step = tab + 4 * world + 1;
    __gm__ int64_t *tasks = tab + 5 * world + 1;
    __gm__ elem_t *in = reinterpret_cast<__gm__ elem_t *>(input);
    __gm__ elem_t *out = reinterpret_cast<__gm__ elem_t *>(output);
    __gm__ elem_t *stage = reinterpret_cast<__gm__ elem_t *>(staging);
    __gm__ int32_t *signals = reinterpret_cast<__gm__ int32_t *>(ready);
    const Status st{reinterpret_cast<__gm__ int64_t *>(status), timeout_cycles};
    AscendC::TPipe pipe;
    AscendC::TBuf<AscendC::TPosition::VECCALC> ub_buf;
    pipe.InitBuffer(ub_buf, UB_TILE_BYTES);
    AscendC::LocalTensor<elem_t> ub = ub_buf.Get<elem_t>();

    if (world > 1) {
        publish_part(stage, in, 1, in_len, 1, publish_col_step, signals, me, world, ub);
    }
    // Tasks flattened over (source, chunk), sources rotated: own piece first.
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
        const Chunk c = chunk_at(within, 1, recv[src], 1, col_step[src]);
        copy_2d(out + recv_offsets[src] + c.col, c.cols, from + send_start[src] + c.col, c.cols, 1, c.cols, ub);
    }
}
