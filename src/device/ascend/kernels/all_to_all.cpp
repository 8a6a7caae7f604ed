// The sequence-parallel all_to_all (Ulysses), fused: the Ascend C twin of src/fused/all_to_all.rs.
//
// A tensor sharded on `gather_dim` becomes the same tensor sharded on `scatter_dim` in one tiled
// copy kernel, with no permute copies. The tensor is seen as five dimensions [A, X, Bm, Y, C]
// (the two named dimensions are X and Y): for each (peer, a, b) what goes to the peer is a 2-D
// block of rows with contiguous runs, so a task is one masked copy of a row block, straight from
// the input into the peer's symmetric receive buffer, laid out as the peer's output. Tasks are
// flattened over (peer, a, b, row block), peers rotated by this rank; the rank's own part goes
// straight to its output. Each task adds one to the peer's signal for this source; once a
// source's count is complete, its blocks are copied from the receive buffer to the output.
// Vector-only kernel: one program per vector core, every one of them communicating.
#include "prelude.h"

using namespace dt;

// One 2-D block copy: `rows` rows of `cols` elements, at `src` (row stride `src_stride`) and
// `dst` (row stride `dst_stride`), offsets in elements.
struct Block {
    int64_t src, src_stride, dst, dst_stride, rows, cols;
};

// The tensor's layout: the host's Layout, read from the table.
struct Layout {
    int64_t a, bm, c, gather_first, scatter_len, world;
    __gm__ int64_t *gathers, *gather_offsets, *scatters, *scatter_offsets;

    __aicore__ inline int64_t gather_total() const { return gather_offsets[world]; }

    // The block rank `src` sends rank `dst` for one (a, b): input offsets in src's input,
    // output offsets in dst's output.
    __aicore__ inline Block block(int64_t src, int64_t dst, int64_t ai, int64_t bi) const {
        const int64_t g = gathers[src], g_off = gather_offsets[src];
        const int64_t s = scatters[dst], s_off = scatter_offsets[dst];
        const int64_t g_total = gather_total();
        Block b;
        if (gather_first != 0) {
            // in: [A, g, Bm, Y, C]; out: [A, G, Bm, s, C]; rows over g, runs of s * C.
            const int64_t y = scatter_len;
            b.src = ((ai * g) * bm + bi) * y * c + s_off * c;
            b.src_stride = bm * y * c;
            b.dst = ((ai * g_total + g_off) * bm + bi) * s * c;
            b.dst_stride = bm * s * c;
            b.rows = g;
            b.cols = s * c;
        } else {
            // in: [A, X, Bm, g, C]; out: [A, s, Bm, G, C]; rows over s, runs of g * C.
            const int64_t x = scatter_len;
            b.src = ((ai * x + s_off) * bm + bi) * g * c;
            b.src_stride = bm * g * c;
            b.dst = ((ai * s) * bm + bi) * g_total * c + g_off * c;
            b.dst_stride = bm * g_total * c;
            b.rows = s;
            b.cols = g * c;
        }
        return b;
    }
};

extern "C" __global__ __aicore__ void all_to_all(
    GM_ADDR x,         // this rank's input shard
    GM_ADDR out,       // this rank's output shard
    GM_ADDR recv,      // symmetric: blocks from peers, laid out as this rank's output
    GM_ADDR arrived,   // symmetric int32 [num_ranks]: blocks from each source landed here
    GM_ADDR table,     // int64: gathers[w], gather_offsets[w+1], scatters[w], scatter_offsets[w+1],
                       // send_rows_per_task[w] (by destination), recv_rows_per_task[w] (by
                       // source), expected[w] (by source, cumulative), send_tasks[w] (by
                       // destination), recv_tasks[w] (by source)
    GM_ADDR status,    // int64 [8]: what a wait that timed out saw
    int64_t rank, int64_t num_ranks, int64_t a, int64_t bm, int64_t c, int64_t gather_first,
    int64_t scatter_len, int64_t timeout_cycles)
{
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
    const int64_t me = rank, world = num_ranks;
    const int64_t pid = program_id_vec(), ncore = num_programs();
    __gm__ int64_t *tab = reinterpret_cast<__gm__ int64_t *>(table);
    const Layout layout{a, bm, c, gather_first, scatter_len, world,
                        tab, tab + world, tab + 2 * world + 1, tab + 3 * world + 1};
    __gm__ int64_t *send_rows = tab + 4 * world + 2;
    __gm__ int64_t *recv_rows = tab + 5 * world + 2;
    __gm__ int64_t *want = tab + 6 * world + 2;
    __gm__ int64_t *send_tasks = tab + 7 * world + 2;
    __gm__ int64_t *recv_tasks = tab + 8 * world + 2;
    __gm__ int32_t *signals = reinterpret_cast<__gm__ int32_t *>(arrived);
    __gm__ elem_t *input = reinterpret_cast<__gm__ elem_t *>(x);
    __gm__ elem_t *output = reinterpret_cast<__gm__ elem_t *>(out);
    __gm__ elem_t *recv_buf = reinterpret_cast<__gm__ elem_t *>(recv);
    const Status st{reinterpret_cast<__gm__ int64_t *>(status), timeout_cycles};
    const int64_t ab = a * bm;
    AscendC::TPipe pipe;
    AscendC::TBuf<AscendC::TPosition::VECCALC> ub_buf;
    pipe.InitBuffer(ub_buf, UB_TILE_BYTES);
    AscendC::LocalTensor<elem_t> ub = ub_buf.Get<elem_t>();

    // ---- send: tasks (peer i, a, b, row block), peers rotated; own part straight to out ----
    int64_t total = total_rotated(me, world, 0, send_tasks);
    for (int64_t t = pid; t < total; t += ncore) {
        int64_t within = 0;
        const int64_t dst = locate_rotated(t, me, world, 0, send_tasks, within);
        const int64_t per_ab = send_tasks[dst] / ab;
        const int64_t ab_index = within / per_ab, row_block = within % per_ab;
        const Block b = layout.block(me, dst, ab_index / bm, ab_index % bm);
        const int64_t row = row_block * send_rows[dst];
        const int64_t rows = valid_len(row, send_rows[dst], b.rows);  // a mask, not padding
        __gm__ elem_t *from = input + b.src + row * b.src_stride;
        const int64_t at = b.dst + row * b.dst_stride;
        if (dst == me) {
            copy_2d(output + at, b.dst_stride, from, b.src_stride, rows, b.cols, ub);
        } else {
            copy_2d(symm_at(recv_buf, dst) + at, b.dst_stride, from, b.src_stride, rows, b.cols, ub);
            notify_add(signals, me, dst, 1);
        }
    }

    // ---- receive: each source's blocks, once its count is complete, into out ----------------
    total = total_rotated(me, world, 1, recv_tasks);
    int64_t held = -1;
    Token token{false};
    for (int64_t t = pid; t < total; t += ncore) {
        int64_t within = 0;
        const int64_t src = locate_rotated(t, me, world, 1, recv_tasks, within);
        const int64_t per_ab = recv_tasks[src] / ab;
        if (held != src) {
            token = wait_ge(signals, src, static_cast<int32_t>(want[src]), st, pid, 0);
            held = src;
        }
        if (!token.ok) {
            return;  // the host reads the status record and reports the timeout
        }
        const int64_t ab_index = within / per_ab, row_block = within % per_ab;
        const Block b = layout.block(src, me, ab_index / bm, ab_index % bm);
        const int64_t row = row_block * recv_rows[src];
        const int64_t rows = valid_len(row, recv_rows[src], b.rows);
        const int64_t at = b.dst + row * b.dst_stride;
        __gm__ elem_t *from = consume_token(recv_buf, token) + at;
        copy_2d(output + at, b.dst_stride, from, b.dst_stride, rows, b.cols, ub);
    }
}
