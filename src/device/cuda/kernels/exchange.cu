// Moves contiguous runs of elements between ranks: the Ulysses all_to_all, all_gather, broadcast
// and local permutes are all this kernel with different runs.
//
// Modes: 0 local (runs copy `mine` to `local`, no peers); 1 pull (every rank publishes its input
// `mine`, then reads part i from rank (rank + i) % world into its output `local`); 2 push (writes
// part i from its input `local` into `peers[i]`, rank (rank + i) % world's output in symmetric
// memory, which the caller knows free): no hand-shake before the writes, one after them (the
// kernel ends once every peer's writes to this rank are complete). Tasks are
// (part, run, chunk), flattened and walked grid-stride by warps; each warp moves one chunk with
// 16-byte accesses where the run allows.

struct ExchangeArgs {
    Ctl ctl;
    Sync sync;
    u32 mode;
    u32 nparts;
    u64 mine;
    u64 local;
    u64 prefix[DT_MAX_RANKS + 1];   // tasks before part i
    Runs runs[DT_MAX_RANKS];
    u64 peers[DT_MAX_RANKS];        // mode 2: the output of rank (rank + i) % world
};

__device__ __forceinline__ void copy_chunk(elem_t* dst, const elem_t* src, u64 len, u32 lane) {
    const u64 bytes = len * sizeof(elem_t);
    if ((((u64)dst | (u64)src | bytes) & 15) == 0) {
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        const u64 n = bytes >> 4;
        u64 k = lane;
        // Eight 16-byte loads in flight per lane before the first store: remote reads over
        // NVLink take microseconds, so bandwidth needs many outstanding loads.
        for (; k + 224 < n; k += 256) {
            uint4 v[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = s[k + 32 * j];
#pragma unroll
            for (int j = 0; j < 8; ++j) d[k + 32 * j] = v[j];
        }
        for (; k < n; k += 32) d[k] = s[k];
    } else {
        for (u64 k = lane; k < len; k += 32) dst[k] = src[k];
    }
}

extern "C" __global__ void __launch_bounds__(256) dt_exchange(const __grid_constant__ ExchangeArgs a) {
    __shared__ u64 ptrs[DT_MAX_RANKS];
    if (a.mode == 1) {
        if (!dt_publish_and_wait(a.ctl, a.sync, a.mine, ptrs)) return;
    } else if (a.mode == 2) {
        if (threadIdx.x < DT_MAX_RANKS) ptrs[threadIdx.x] = a.peers[threadIdx.x];
        __syncthreads();
    }
    const u32 lane = threadIdx.x & 31;
    const u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u64 nwarps = ((u64)gridDim.x * blockDim.x) >> 5;
    const u64 total = a.prefix[a.nparts];
    for (u64 t = warp; t < total; t += nwarps) {
        u32 i = 0;
        while (t >= a.prefix[i + 1]) ++i;
        const Runs& r = a.runs[i];
        const u64 task = t - a.prefix[i];
        const u64 q = task / r.chunks;
        const u64 c = task - q * r.chunks;
        u64 so, dof;
        run_offsets(r, q, &so, &dof);
        const u64 start = c * r.chunk;
        const u64 len = min(r.chunk, r.len - start);  // the mask of the last chunk
        const elem_t* src;
        elem_t* dst;
        if (a.mode == 0) {
            src = (const elem_t*)a.mine;
            dst = (elem_t*)a.local;
        } else if (a.mode == 1) {
            src = (const elem_t*)ptrs[i];
            dst = (elem_t*)a.local;
        } else {
            src = (const elem_t*)a.local;
            dst = (elem_t*)ptrs[i];
        }
        copy_chunk(dst + dof + start, src + so + start, len, lane);
    }
    if (a.mode != 0) dt_finish(a.ctl, a.sync, true);
}
