// all_gather + matmul, fused: the Ascend C twin of src/fused/all_gather_matmul.rs.
//
// `[m_r, K]` row shards times this rank's `[K, N]` weight give the whole `[M, N]` product, each
// shard multiplied as soon as it has arrived. Mix kernel (cube:vector 1:2). On vector sub-core 0
// of every AI core the communication part pushes this rank's rows into every peer's symmetric
// `gathered` buffer (peers rotated by this rank, chunks flattened over (peer, chunk) and shared
// out grid-stride), adding one to the peer's `arrived[this rank]` per chunk. On the other
// sub-cores the compute part walks output tiles grid-stride, its own shard first (read straight
// from `x`, so work starts before anything arrives), then the shards in the order peers send
// them; before a shard's first tile it waits for all of that shard's chunks, consumes the
// token, and multiplies the tile on the cube unit, with masks at ragged edges.
//
// Differences from the host kernel: the host widens half types to f32 before it multiplies (its
// GEMM crate has no f16 kernel), the cube unit multiplies them as they are and accumulates in
// f32; and the host, for short shards, also tiles over all gathered rows at once to read the
// weight once (a cache choice for CPUs), which this kernel does not do.
#include "gemm.h"

using namespace dt;

extern "C" __global__ __aicore__ void all_gather_matmul(
    GM_ADDR x,            // [m_me, K] elem_t: this rank's rows
    GM_ADDR w,            // [K, N] elem_t: this rank's weight
    GM_ADDR out,          // [M, N] elem_t: the product
    GM_ADDR gathered,     // symmetric [M, K] elem_t: every rank's rows at their global offsets
    GM_ADDR arrived,      // symmetric int32 [num_ranks]: chunks of each shard landed here
    GM_ADDR row_offsets,  // int64 [num_ranks + 1]: where each rank's rows start
    GM_ADDR expected,     // int64 [num_ranks]: the count of `arrived[s]` that means shard s is here
    GM_ADDR status,       // int64 [8]: what a wait that timed out saw
    GM_ADDR workspace,    // the Matmul library's system workspace
    int64_t rank, int64_t num_ranks, int64_t k, int64_t n,
    int64_t push,         // 1: push this rank's rows; 0: a later weight of the same call, rows already there
    int64_t row_step, int64_t col_step,  // the push chunks (host TilePlan)
    int64_t block_m, int64_t block_n,    // the output tiles
    int64_t timeout_cycles)
{
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
    AscendC::SetSysWorkspace(workspace);
    __gm__ int64_t *offs = reinterpret_cast<__gm__ int64_t *>(row_offsets);
    __gm__ int64_t *want = reinterpret_cast<__gm__ int64_t *>(expected);
    __gm__ int32_t *signals = reinterpret_cast<__gm__ int32_t *>(arrived);
    __gm__ elem_t *input = reinterpret_cast<__gm__ elem_t *>(x);
    __gm__ elem_t *rows_buf = reinterpret_cast<__gm__ elem_t *>(gathered);
    const int64_t me = rank, world = num_ranks;
    const int64_t pid = program_id_mix(), ncore = num_programs(), sub = sub_vec_id_mix();
    const Status st{reinterpret_cast<__gm__ int64_t *>(status), timeout_cycles};
    AscendC::TPipe pipe;
    const int64_t m_total = offs[world];

    // ---- the cube: every core declares the product; REGIST_MATMUL_OBJ makes the AI core's cube
    // the server of its vector sub-cores' products and returns there on the cube (as Ascend C's
    // macro does on the AIC), so nothing below runs on the cube. Every vector sub-core registers
    // and ends its client, whether it multiplies or not. ------------------------------------
    TCubeTiling tiling;
    gemm_tiling(tiling, m_total, n, k, block_m, block_n);
    matmul::Matmul<matmul::MatmulType<AscendC::TPosition::GM, CubeFormat::ND, elem_t>,
                   matmul::MatmulType<AscendC::TPosition::GM, CubeFormat::ND, elem_t>,
                   matmul::MatmulType<AscendC::TPosition::GM, CubeFormat::ND, elem_t>,
                   matmul::MatmulType<AscendC::TPosition::GM, CubeFormat::ND, acc_t>>
        mm;
    REGIST_MATMUL_OBJ(&pipe, GetSysWorkSpacePtr(), mm, &tiling);

    // ---- communication: sub-core 0 pushes this rank's rows to every peer -------------------
    if (world > 1 && push != 0 && sub == 0) {
        AscendC::TBuf<AscendC::TPosition::VECCALC> ub_buf;
        pipe.InitBuffer(ub_buf, UB_TILE_BYTES);
        AscendC::LocalTensor<elem_t> ub = ub_buf.Get<elem_t>();
        const int64_t mine = offs[me + 1] - offs[me];
        const int64_t chunks = chunk_count(mine, k, row_step, col_step);
        // Tasks flattened over (peer, chunk); peers rotated so no peer is hit by all at once.
        for (int64_t task = pid; task < (world - 1) * chunks; task += ncore) {
            const int64_t peer = (me + 1 + task / chunks) % world;
            const Chunk c = chunk_at(task % chunks, mine, k, row_step, col_step);
            __gm__ elem_t *dst = symm_at(rows_buf, peer) + (offs[me] + c.row) * k + c.col;
            copy_2d(dst, k, input + c.row * k + c.col, k, c.rows, c.cols, ub);
            notify_add(signals, me, peer, 1);
        }
    }

    // ---- compute: the other sub-cores multiply output tiles, own shard first --------------
    const int64_t lane = compute_lane();
    if (lane < 0) {
        mm.End();
        return;
    }
    const int64_t lanes = compute_lanes();
    const int64_t col_tiles = ceil_div(n, block_n);
    mm.SetOrgShape(static_cast<int>(m_total), static_cast<int>(n), static_cast<int>(k));
    AscendC::GlobalTensor<elem_t> a_gm, b_gm, c_gm;
    b_gm.SetGlobalBuffer(reinterpret_cast<__gm__ elem_t *>(w), k * n);
    c_gm.SetGlobalBuffer(reinterpret_cast<__gm__ elem_t *>(out), m_total * n);

    // Total tiles over the segments (shard (me + i) % world for i = 0, 1, ...).
    int64_t total = 0;
    for (int64_t i = 0; i < world; ++i) {
        const int64_t s = (me + i) % world;
        total += ceil_div(offs[s + 1] - offs[s], block_m) * col_tiles;
    }
    // A program's tasks visit the segments in order, so one token (that of its current shard)
    // is all it holds; it waits once per shard it works on.
    int64_t held = -1;
    Token token{true};
    for (int64_t t = lane; t < total; t += lanes) {
        // Which segment, and which tile of it.
        int64_t i = 0, start = 0, tiles = 0, s = me;
        for (; i < world; ++i) {
            s = (me + i) % world;
            tiles = ceil_div(offs[s + 1] - offs[s], block_m) * col_tiles;
            if (t < start + tiles) {
                break;
            }
            start += tiles;
        }
        const int64_t within = t - start;
        const int64_t rows_s = offs[s + 1] - offs[s];
        const int64_t row = (within / col_tiles) * block_m;
        const int64_t col = (within % col_tiles) * block_n;
        const int64_t rows = valid_len(row, block_m, rows_s);  // masks, never padding
        const int64_t cols = valid_len(col, block_n, n);
        __gm__ elem_t *a = nullptr;
        if (s == me) {
            a = input + row * k;
        } else {
            if (held != s) {
                token = wait_ge(signals, s, static_cast<int32_t>(want[s]), st, pid, sub);
                held = s;
            }
            if (!token.ok) {
                break;  // the host reads the status record and reports the timeout
            }
            a = consume_token(rows_buf, token) + (offs[s] + row) * k;
        }
        a_gm.SetGlobalBuffer(a, rows * k);
        mm.SetTensorA(a_gm);
        mm.SetTensorB(b_gm[col]);
        mm.SetSingleShape(static_cast<int>(rows), static_cast<int>(cols), static_cast<int>(k));
        mm.IterateAll(c_gm[(offs[s] + row) * n + col]);
    }
    mm.End();
}
