// matmul + reduce_scatter, fused: the Ascend C twin of src/fused/matmul_reduce_scatter.rs.
//
// `[M, k_r]` column shards times this rank's `[k_r, N]` weight, summed over ranks, each rank
// keeping its own rows `[m_r, N]`. Mix kernel (cube:vector 1:2). The compute part (the sub-cores
// after 0) walks the partial product's tiles grid-stride, the rows other ranks own first (rank
// me + 1's, then me + 2's, ..., its own last), writes each tile in f32 into this rank's
// symmetric `partials`, and counts it for the rows' owner. The communication part (sub-core 0):
// once every tile of an owner's rows is done it tells that owner (peers rotated), then it waits
// until every rank has told this one, pulls their partials for this rank's rows through
// symm_at (sources rotated, so ranks do not all read the same peer at once), adds them in rank
// order 0, 1, 2, ... in f32 and rounds once: the same bits on every run, whatever the timing.
//
// Differences from the host kernel: the host signals the owner once per tile from the computing
// thread; here the computing sub-cores count tiles locally and sub-core 0 sends one signal per
// owner, so that all communication stays on sub-core 0 (the seed's rule for mix kernels), and
// only sub-core 0 reduces; and the host loads the partials in rank order where this kernel
// loads them rotated (into one unified-buffer slot per source) and adds them in rank order,
// which gives the host's bits. The host also tiles over all rows at once when shards are short
// (a CPU cache choice) and widens half types before multiplying; this kernel does neither.
#include "gemm.h"

using namespace dt;

extern "C" __global__ __aicore__ void matmul_reduce_scatter(
    GM_ADDR x,            // [M, k_r] elem_t: this rank's columns of the left operand
    GM_ADDR w,            // [k_r, N] elem_t: this rank's rows of the weight
    GM_ADDR out,          // [m_me, N] elem_t: this rank's rows of the sum
    GM_ADDR partials,     // symmetric [M, N] acc_t: this rank's partial product
    GM_ADDR signals,      // symmetric int32 [2 * num_ranks]: [s] rank s's partials for my rows
                          // are done; [num_ranks + o] tiles of owner o's rows done here
    GM_ADDR row_offsets,  // int64 [num_ranks + 1]: where each rank's rows start
    GM_ADDR expected,     // int64 [num_ranks + 1]: [o] tiles of owner o's rows, cumulative;
                          // [num_ranks] calls so far (what every `signals[s]` reaches)
    GM_ADDR status,       // int64 [8]: what a wait that timed out saw
    GM_ADDR workspace,    // the Matmul library's system workspace
    int64_t rank, int64_t num_ranks, int64_t k, int64_t n,
    int64_t block_m, int64_t block_n,    // the partial product's tiles
    int64_t row_step, int64_t col_step,  // the reduction's chunks (host TilePlan)
    int64_t slot_bytes,                  // one UB slot: UB_REDUCE_BYTES / (num_ranks + 2)
    int64_t timeout_cycles)
{
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
    AscendC::SetSysWorkspace(workspace);
    __gm__ int64_t *offs = reinterpret_cast<__gm__ int64_t *>(row_offsets);
    __gm__ int64_t *want = reinterpret_cast<__gm__ int64_t *>(expected);
    __gm__ int32_t *sig = reinterpret_cast<__gm__ int32_t *>(signals);
    __gm__ acc_t *part_buf = reinterpret_cast<__gm__ acc_t *>(partials);
    const int64_t me = rank, world = num_ranks;
    const int64_t pid = program_id_mix(), ncore = num_programs(), sub = sub_vec_id_mix();
    const Status st{reinterpret_cast<__gm__ int64_t *>(status), timeout_cycles};
    const int64_t m_total = offs[world];
    const int64_t col_tiles = ceil_div(n, block_n);
    AscendC::TPipe pipe;

    // ---- the cube: every core declares the product; REGIST_MATMUL_OBJ makes the AI core's cube
    // the server of its vector sub-cores' products and returns there on the cube (as Ascend C's
    // macro does on the AIC), so nothing below runs on the cube. Every vector sub-core registers
    // and ends its client, whether it multiplies or not. ------------------------------------
    TCubeTiling tiling;
    gemm_tiling(tiling, m_total, n, k, block_m, block_n);
    matmul::Matmul<matmul::MatmulType<AscendC::TPosition::GM, CubeFormat::ND, elem_t>,
                   matmul::MatmulType<AscendC::TPosition::GM, CubeFormat::ND, elem_t>,
                   matmul::MatmulType<AscendC::TPosition::GM, CubeFormat::ND, acc_t>,
                   matmul::MatmulType<AscendC::TPosition::GM, CubeFormat::ND, acc_t>>
        mm;
    REGIST_MATMUL_OBJ(&pipe, GetSysWorkSpacePtr(), mm, &tiling);

    // ---- compute: partial tiles, other owners' rows first ----------------------------------
    const int64_t lane = compute_lane();
    if (lane >= 0) {
        const int64_t lanes = compute_lanes();
        mm.SetOrgShape(static_cast<int>(m_total), static_cast<int>(n), static_cast<int>(k));
        AscendC::GlobalTensor<elem_t> a_gm, b_gm;
        AscendC::GlobalTensor<acc_t> c_gm;
        a_gm.SetGlobalBuffer(reinterpret_cast<__gm__ elem_t *>(x), m_total * k);
        b_gm.SetGlobalBuffer(reinterpret_cast<__gm__ elem_t *>(w), k * n);
        c_gm.SetGlobalBuffer(part_buf, m_total * n);
        int64_t total = 0;
        for (int64_t i = 1; i <= world; ++i) {
            const int64_t o = (me + i) % world;
            total += ceil_div(offs[o + 1] - offs[o], block_m) * col_tiles;
        }
        for (int64_t t = lane; t < total; t += lanes) {
            int64_t start = 0, tiles = 0, o = me;
            for (int64_t i = 1; i <= world; ++i) {
                o = (me + i) % world;  // owners rotated: the rows others need first, own last
                tiles = ceil_div(offs[o + 1] - offs[o], block_m) * col_tiles;
                if (t < start + tiles) {
                    break;
                }
                start += tiles;
            }
            const int64_t within = t - start;
            const int64_t row = offs[o] + (within / col_tiles) * block_m;
            const int64_t col = (within % col_tiles) * block_n;
            const int64_t rows = valid_len(row - offs[o], block_m, offs[o + 1] - offs[o]);
            const int64_t cols = valid_len(col, block_n, n);
            mm.SetTensorA(a_gm[row * k]);
            mm.SetTensorB(b_gm[col]);
            mm.SetSingleShape(static_cast<int>(rows), static_cast<int>(cols), static_cast<int>(k));
            mm.IterateAll(c_gm[row * n + col]);  // the partial, in f32, into symmetric memory
            count_local(sig, world + o, me, 1);
        }
    }
    mm.End();
    if (sub != 0) {
        return;
    }

    // ---- communication: tell each owner, rotated, once its rows' tiles are all done --------
    for (int64_t t = pid; t < world; t += ncore) {
        const int64_t owner = (me + 1 + t) % world;
        const Token done = wait_ge(sig, world + owner, static_cast<int32_t>(want[owner]), st, pid, sub);
        if (!done.ok) {
            return;
        }
        notify_add(sig, me, owner, 1);
    }

    // ---- reduction: this rank's rows of every rank's partials, added in rank order ---------
    // The unified buffer in num_ranks + 2 slots: a part per source, the f32 sum, the rounded tile.
    AscendC::TBuf<AscendC::TPosition::VECCALC> ub_buf;
    pipe.InitBuffer(ub_buf, UB_REDUCE_BYTES);
    AscendC::LocalTensor<uint8_t> ub_bytes = ub_buf.Get<uint8_t>();
    AscendC::LocalTensor<acc_t> sum = ub_bytes[world * slot_bytes].ReinterpretCast<acc_t>();
    AscendC::LocalTensor<elem_t> rounded = ub_bytes[(world + 1) * slot_bytes].ReinterpretCast<elem_t>();
    const int64_t mine = offs[me + 1] - offs[me];
    const int64_t chunks = chunk_count(mine, n, row_step, col_step);
    if (pid >= chunks) {
        return;
    }
    // Every rank's partials for this rank's rows: one token for them all.
    Token all_here{true};
    for (int64_t src = 0; src < world && all_here.ok; ++src) {
        all_here = wait_ge(sig, src, static_cast<int32_t>(want[world]), st, pid, sub);
    }
    if (!all_here.ok) {
        return;  // the host reads the status record and reports the timeout
    }
    for (int64_t t = pid; t < chunks; t += ncore) {
        const Chunk c = chunk_at(t, mine, n, row_step, col_step);
        const int64_t at = (offs[me] + c.row) * n + c.col;
        // Load in rotated order...
        for (int64_t i = 0; i < world; ++i) {
            const int64_t src = (me + i) % world;
            __gm__ acc_t *from = consume_token(symm_at(part_buf, src), all_here) + at;
            AscendC::LocalTensor<acc_t> part = ub_bytes[src * slot_bytes].ReinterpretCast<acc_t>();
            load_2d(part, from, n, c.rows, c.cols);
        }
        AscendC::SetFlag<AscendC::HardEvent::MTE2_V>(EVENT_ID0);
        AscendC::WaitFlag<AscendC::HardEvent::MTE2_V>(EVENT_ID0);
        // ...and add in rank order 0, 1, 2, ...: the same bits on every run.
        const int32_t count = static_cast<int32_t>(c.rows * ub_pitch<acc_t>(c.cols));
        for (int64_t src = 0; src < world; ++src) {
            AscendC::LocalTensor<acc_t> part = ub_bytes[src * slot_bytes].ReinterpretCast<acc_t>();
            if (src == 0) {
                AscendC::Adds(sum, part, 0.0f, count);
            } else {
                AscendC::Add(sum, sum, part, count);
            }
            AscendC::PipeBarrier<PIPE_V>();
        }
        round_store(reinterpret_cast<__gm__ elem_t *>(out) + c.row * n + c.col, n, sum, rounded, c.rows, c.cols);
    }
}
