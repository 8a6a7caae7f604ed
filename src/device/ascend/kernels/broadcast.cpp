// broadcast: the Ascend C twin of src/collectives/broadcast.rs. The root publishes its data;
// every rank (the root from its own input) copies it to its output, chunks grid-stride.
#include "collective.h"

using namespace dt;

extern "C" __global__ __aicore__ void broadcast(
    GM_ADDR input,    // [len] elem_t: the root's data (unused on other ranks)
    GM_ADDR output,   // [len] elem_t
    GM_ADDR staging,  // symmetric elem_t: the root's published data
    GM_ADDR ready,    // symmetric int32 [num_ranks]: programs of each rank that have published
    GM_ADDR status,   // int64 [8]: what a wait that timed out saw
    int64_t rank, int64_t num_ranks, int64_t root, int64_t len,
    int64_t col_step,  // the chunks (host TilePlan over one row of len)
    int64_t ready_at,  // the root's count that means this call's data is there
    int64_t timeout_cycles)
{
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
    const int64_t me = rank, world = num_ranks;
    const int64_t pid = program_id_vec(), ncore = num_programs();
    __gm__ elem_t *in = reinterpret_cast<__gm__ elem_t *>(input);
    __gm__ elem_t *out = reinterpret_cast<__gm__ elem_t *>(output);
    __gm__ elem_t *stage = reinterpret_cast<__gm__ elem_t *>(staging);
    __gm__ int32_t *signals = reinterpret_cast<__gm__ int32_t *>(ready);
    const Status st{reinterpret_cast<__gm__ int64_t *>(status), timeout_cycles};
    AscendC::TPipe pipe;
    AscendC::TBuf<AscendC::TPosition::VECCALC> ub_buf;
    pipe.InitBuffer(ub_buf, UB_TILE_BYTES);
    AscendC::LocalTensor<elem_t> ub = ub_buf.Get<elem_t>();

    if (me == root && world > 1) {
        publish_part(stage, in, 1, len, 1, col_step, signals, me, world, ub);
    }
    const int64_t chunks = chunk_count(1, len, 1, col_step);
    if (pid >= chunks) {
        return;
    }
    __gm__ elem_t *from = source(stage, in, root, me, signals, ready_at, st);
    if (from == nullptr) {
        return;  // the host reads the status record and reports the timeout
    }
    for (int64_t t = pid; t < chunks; t += ncore) {
        const Chunk c = chunk_at(t, 1, len, 1, col_step);
        copy_2d(out + c.col, c.cols, from + c.col, c.cols, 1, c.cols, ub);
    }
}
