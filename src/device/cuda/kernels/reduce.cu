// Sums one part from every rank in rank order (0, 1, ..., world - 1), accumulating in acc_t and
// rounding once: bitwise the same result on every run.
//
// Mode 1 (collectives): every rank publishes its input `mine` (elements); the runs say which
// elements of every input this rank sums and where they go in `out`; the kernel ends once no
// peer reads `mine` any more. Mode 2 (matmul_reduce_scatter, chunked): the partials (f32, or f64
// for f64) are already here (`parts[s]`, pushed by rank s into this rank's symmetric buffer, or
// its own); wait until each pusher said ready, sum, then tell each it may push again. Mode 3
// (matmul_reduce_scatter, single): as mode 1, but the published inputs are partials.

struct ReduceArgs {
    Ctl ctl;
    Sync sync;
    u32 mode;
    u32 world;
    u64 mine;
    u64 out;
    u64 parts[DT_MAX_RANKS];
    Runs runs;
};

#if DT_ELEM == 1
typedef double part_t;  // f64 products stay f64
#else
typedef float part_t;   // f32, f16 and bf16 products accumulate in f32
#endif

template <typename Src>
__device__ __forceinline__ acc_t load_acc(const Src* p, u64 i);
template <>
__device__ __forceinline__ acc_t load_acc<float>(const float* p, u64 i) { return (acc_t)p[i]; }
#if DT_ELEM != 0
template <>
__device__ __forceinline__ acc_t load_acc<elem_t>(const elem_t* p, u64 i) { return to_acc(p[i]); }
#endif

template <typename Src>
__device__ void reduce_tasks(const ReduceArgs& a, const u64* srcs) {
    const Runs& r = a.runs;
    const u32 lane = threadIdx.x & 31;
    const u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u64 nwarps = ((u64)gridDim.x * blockDim.x) >> 5;
    const u64 total = r.count * r.chunks;
    elem_t* out = (elem_t*)a.out;
    for (u64 t = warp; t < total; t += nwarps) {
        const u64 q = t / r.chunks;
        const u64 c = t - q * r.chunks;
        u64 so, dof;
        run_offsets(r, q, &so, &dof);
        const u64 start = c * r.chunk;
        const u64 len = min(r.chunk, r.len - start);
        so += start;
        dof += start;
        u64 k = lane;
        // Eight elements per lane per step, independent, so that loads from every rank are in
        // flight together: reads of a peer's memory over NVLink take microseconds, and a warp
        // with few loads outstanding leaves the link idle.
        for (; k + 224 < len; k += 256) {
            acc_t acc[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[j] = load_acc<Src>((const Src*)srcs[0], so + k + 32 * j);
            for (u32 s = 1; s < a.world; ++s) {
                const Src* p = (const Src*)srcs[s];
                acc_t v[8];
#pragma unroll
                for (int j = 0; j < 8; ++j) v[j] = load_acc<Src>(p, so + k + 32 * j);
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[j] += v[j];
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) out[dof + k + 32 * j] = from_acc(acc[j]);
        }
        for (; k < len; k += 32) {
            acc_t acc = load_acc<Src>((const Src*)srcs[0], so + k);
            for (u32 s = 1; s < a.world; ++s) acc += load_acc<Src>((const Src*)srcs[s], so + k);
            out[dof + k] = from_acc(acc);
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) dt_reduce(const __grid_constant__ ReduceArgs a) {
    __shared__ u64 ptrs[DT_MAX_RANKS];
    __shared__ u64 srcs[DT_MAX_RANKS];
    if (a.mode == 1) {
        if (!dt_publish_and_wait(a.ctl, a.sync, a.mine, ptrs)) return;
        // ptrs[i] belongs to rank (rank + i) % world; sum in rank order.
        if (threadIdx.x < a.world) srcs[(a.sync.rank + threadIdx.x) % a.world] = ptrs[threadIdx.x];
        __syncthreads();
        reduce_tasks<elem_t>(a, srcs);
        dt_finish(a.ctl, a.sync, true);
    } else if (a.mode == 3) {
        if (!dt_publish_and_wait(a.ctl, a.sync, a.mine, ptrs)) return;
        if (threadIdx.x < a.world) srcs[(a.sync.rank + threadIdx.x) % a.world] = ptrs[threadIdx.x];
        __syncthreads();
        reduce_tasks<part_t>(a, srcs);
        dt_finish(a.ctl, a.sync, true);
    } else {
        if (!dt_wait_ready(a.ctl, a.sync)) return;
        reduce_tasks<part_t>(a, a.parts);
        dt_finish(a.ctl, a.sync, false);
    }
}
