// The backward pass of rms_norm and layer_norm over rows of `n` (the last axis), as the host's
// f64 pass in src/tensor/norm_grad.rs computes it:
//
//   x^ = (x - mean) r, r = 1 / sqrt(mean((x - mean)^2) + eps) (mean = 0 for rms_norm),
//   dx^ = dy w (w = 1 without a weight),
//   dx = r (dx^ - mean(dx^) - x^ mean(dx^ x^)) (no mean(dx^) term for rms_norm),
//   dw = sum over rows of dy x^, db = sum over rows of dy.
//
// Statistics and sums run in grad_t: f64 for f32 and f64 (the host's f64 reference holds f32 to
// a few units of its roundoff, which f32 sums over thousands of elements would use up), f32 for
// the half types (whose one rounding to 8 or 11 bits hides f32's few ulp). Each output rounds
// once.
//
// dt_norm_grad_rows: one block per row, grid-stride over rows: the row's mean and r (kept in
// `stats` for the weight gradients), the two row means, then dx. The rows are read from global
// memory on each pass (a row being worked on stays in L1 / L2).
// dt_norm_grad_columns + dt_norm_grad_partials: dw and db, the column sums of dy x^ and dy, in
// two passes as dt_sum_columns (local.cu) does: block (tile, chunk) adds rows
// [chunk * chunk_rows, (chunk + 1) * chunk_rows) of 32 neighbouring columns (32 threads across,
// 8 down, then the 8 in order) into partial[chunk]; then one thread per column adds its chunks'
// partials in order. Fixed chunks: the order of the sums depends on the sizes only.

struct NormGradArgs {
    u64 dx, x, w, g;    // dx, x, dy: rows * n elements; w: n elements, or 0 for none
    u64 stats;          // grad_t[2 * rows]: (mean, r) of each row, or 0 when not wanted
    u64 dw, db;         // n elements each
    u64 partial;        // grad_t[chunks * 2 * n]: per chunk, n sums of dy x^ then n of dy
    u64 rows, n;
    u64 chunk_rows, chunks;
    double eps;
    u32 centered;       // 1: layer_norm, 0: rms_norm
};

// The sum of `v` over the block (blockDim.x a multiple of 32, at most 1024), in every thread.
// Every thread of the block calls it; the first barrier keeps a previous call's readers of
// `scratch` ahead of this call's writers.
__device__ __forceinline__ grad_t block_sum_grad(grad_t v, grad_t* scratch) {
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : (grad_t)0;
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

extern "C" __global__ void __launch_bounds__(256)
    dt_norm_grad_rows(const __grid_constant__ NormGradArgs a) {
    __shared__ grad_t scratch[32];
    elem_t* dx = (elem_t*)a.dx;
    const elem_t* x = (const elem_t*)a.x;
    const elem_t* w = (const elem_t*)a.w;
    const elem_t* g = (const elem_t*)a.g;
    grad_t* stats = (grad_t*)a.stats;
    const grad_t count = (grad_t)a.n, eps = (grad_t)a.eps;
    for (u64 row = blockIdx.x; row < a.rows; row += gridDim.x) {
        const elem_t* xr = x + row * a.n;
        const elem_t* gr = g + row * a.n;
        elem_t* dxr = dx + row * a.n;
        grad_t mean = 0;
        if (a.centered) {
            grad_t s = 0;
            for (u64 j = threadIdx.x; j < a.n; j += blockDim.x) s += to_grad(xr[j]);
            mean = block_sum_grad(s, scratch) / count;
        }
        grad_t q = 0;
        for (u64 j = threadIdx.x; j < a.n; j += blockDim.x) {
            const grad_t v = to_grad(xr[j]) - mean;
            q += v * v;
        }
        const grad_t r = (grad_t)1 / sqrt(block_sum_grad(q, scratch) / count + eps);
        grad_t sgh = 0, sghxh = 0;
        for (u64 j = threadIdx.x; j < a.n; j += blockDim.x) {
            const grad_t xh = (to_grad(xr[j]) - mean) * r;
            const grad_t gh = w ? to_grad(gr[j]) * to_grad(w[j]) : to_grad(gr[j]);
            sgh += gh;
            sghxh += gh * xh;
        }
        const grad_t mean_gh = a.centered ? block_sum_grad(sgh, scratch) / count : (grad_t)0;
        const grad_t mean_ghxh = block_sum_grad(sghxh, scratch) / count;
        for (u64 j = threadIdx.x; j < a.n; j += blockDim.x) {
            const grad_t xh = (to_grad(xr[j]) - mean) * r;
            const grad_t gh = w ? to_grad(gr[j]) * to_grad(w[j]) : to_grad(gr[j]);
            dxr[j] = from_grad(r * (gh - mean_gh - xh * mean_ghxh));
        }
        if (stats && threadIdx.x == 0) {
            stats[2 * row] = mean;
            stats[2 * row + 1] = r;
        }
    }
}

// Launched with 256 threads a block (8 rows of 32).
extern "C" __global__ void __launch_bounds__(256)
    dt_norm_grad_columns(const __grid_constant__ NormGradArgs a) {
    __shared__ grad_t part_w[8][33];
    __shared__ grad_t part_b[8][33];
    const elem_t* x = (const elem_t*)a.x;
    const elem_t* g = (const elem_t*)a.g;
    const grad_t* stats = (const grad_t*)a.stats;
    grad_t* partial = (grad_t*)a.partial;
    const u64 tiles = (a.n + 31) / 32;
    const u32 tx = threadIdx.x % 32, ty = threadIdx.x / 32;
    for (u64 blk = blockIdx.x; blk < tiles * a.chunks; blk += gridDim.x) {
        const u64 chunk = blk % a.chunks, tile = blk / a.chunks;
        const u64 i = tile * 32 + tx;
        const u64 start = chunk * a.chunk_rows, end = min(start + a.chunk_rows, a.rows);
        grad_t sw = 0, sb = 0;
        if (i < a.n) {
            for (u64 j = start + ty; j < end; j += 8) {
                const grad_t gi = to_grad(g[j * a.n + i]);
                const grad_t xh = (to_grad(x[j * a.n + i]) - stats[2 * j]) * stats[2 * j + 1];
                sw += gi * xh;
                sb += gi;
            }
        }
        part_w[ty][tx] = sw;
        part_b[ty][tx] = sb;
        __syncthreads();
        if (ty == 0 && i < a.n) {
            grad_t tw = 0, tb = 0;
            for (int r = 0; r < 8; r++) {
                tw += part_w[r][tx];
                tb += part_b[r][tx];
            }
            partial[chunk * 2 * a.n + i] = tw;
            partial[chunk * 2 * a.n + a.n + i] = tb;
        }
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(256)
    dt_norm_grad_partials(const __grid_constant__ NormGradArgs a) {
    elem_t* dw = (elem_t*)a.dw;
    elem_t* db = (elem_t*)a.db;
    const grad_t* partial = (const grad_t*)a.partial;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < a.n; i += stride) {
        grad_t tw = 0, tb = 0;
        for (u64 c = 0; c < a.chunks; c++) {
            tw += partial[c * 2 * a.n + i];
            tb += partial[c * 2 * a.n + a.n + i];
        }
        dw[i] = from_grad(tw);
        db[i] = from_grad(tb);
    }
}
