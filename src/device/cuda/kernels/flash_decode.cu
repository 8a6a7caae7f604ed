// The sequence-parallel flash-decode (src/fused/flash_decode.rs): one query per sequence against
// keys split by sequence over the ranks; the twin of the host kernel (device/host/flash_decode.rs).
//
// A task of the first phase is one warp's (sequence b, query head h, chunk c of this rank's
// keys): the scores of the head's query against the chunk (its kv head's keys), their softmax
// and the weighted sum of the values, normalised, and the log-sum-exp: one record [o (dv), lse]
// in acc_t. Records are written where every rank's receive buffer keeps this rank's part
// (source-major; within a source ((b * chunks + c) * heads + h) * (dv + 1)). A task of the
// second phase is one warp's (b, h): the records of every source and chunk, in rank order (the
// same bits on every rank), combined by log-sum-exp weights into the output row.
//
// Modes: 0 the first phase alone, records into recv[0] (the unfused baseline's local part);
// 1 fused: records into every rank's buffer (recv[i] is rank (rank + i) % world's, peers
// rotated), the last block to finish tells every rank (itself too) `ready`, every block waits
// for every rank's `ready` before combining, and the kernel ends once every peer said `done`
// (nobody reads this call's records after that, so the next call may write); 2 the second phase
// alone, from recv[0] (the unfused baseline's gathered records). Launched with every block
// resident in mode 1 (its blocks wait on each other).

#define FD_WARPS 8
#define FD_CHUNK 128
#define FD_MAX_D 256
#define FD_REGS (FD_MAX_D / 32)

#if DT_ELEM == 1
#define ACC_EXP exp
#define ACC_LOG log
#define ACC_MAX fmax
#define ACC_NEG_INF __longlong_as_double(0xfff0000000000000ULL)
#else
#define ACC_EXP expf
#define ACC_LOG logf
#define ACC_MAX fmaxf
#define ACC_NEG_INF __int_as_float(0xff800000)
#endif

struct FlashDecodeArgs {
    Ctl ctl;
    Sync sync;
    u32 mode;
    u32 ndst;                        // buffers the first phase writes (mode 1: world; else 1)
    u32 nsrc;                        // sources the second phase combines
    u32 slot;                        // which source's part this rank's records are
    u64 batch, heads, kv_heads, d, dv;
    double scale;
    u64 q, k, v, out, lse;
    u64 keys;                        // this rank's keys
    u64 chunks[DT_MAX_RANKS];        // every source's chunks of FD_CHUNK keys
    u64 src_off[DT_MAX_RANKS + 1];   // where each source's records start (acc_t elements)
    u64 recv[DT_MAX_RANKS];
};

__device__ __forceinline__ acc_t warp_sum(acc_t x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

__device__ __forceinline__ acc_t warp_max(acc_t x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = ACC_MAX(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

// One first-phase task on one warp (see the top of the file).
__device__ void fd_partial(const FlashDecodeArgs& a, u64 t, u32 lane, acc_t* qs, acc_t* sc) {
    const u64 chunks = a.chunks[a.slot];
    const u64 c = t % chunks, h = (t / chunks) % a.heads, b = t / (chunks * a.heads);
    const u64 kvh = h / (a.heads / a.kv_heads);
    const u64 key0 = c * FD_CHUNK, n = min((u64)FD_CHUNK, a.keys - key0);
    const elem_t* q = (const elem_t*)a.q + (b * a.heads + h) * a.d;
    for (u64 e = lane; e < a.d; e += 32) qs[e] = to_acc(q[e]) * (acc_t)a.scale;
    __syncwarp();
    const u64 k_row = a.kv_heads * a.d, v_row = a.kv_heads * a.dv;
    const elem_t* k = (const elem_t*)a.k + (b * a.keys + key0) * k_row + kvh * a.d;
    const elem_t* v = (const elem_t*)a.v + (b * a.keys + key0) * v_row + kvh * a.dv;
    acc_t m = ACC_NEG_INF;
    for (u64 j = 0; j < n; ++j) {
        acc_t s = 0;
        for (u64 e = lane; e < a.d; e += 32) s += qs[e] * to_acc(k[j * k_row + e]);
        s = warp_sum(s);
        if (lane == 0) sc[j] = s;
        m = ACC_MAX(m, s);
    }
    __syncwarp();
    acc_t l = 0;
    for (u64 j = lane; j < n; j += 32) {
        const acc_t p = ACC_EXP(sc[j] - m);
        sc[j] = p;
        l += p;
    }
    l = warp_sum(l);
    __syncwarp();
    acc_t o[FD_REGS];
#pragma unroll
    for (int i = 0; i < FD_REGS; ++i) o[i] = 0;
    for (u64 j = 0; j < n; ++j) {
        const acc_t p = sc[j];
#pragma unroll
        for (int i = 0; i < FD_REGS; ++i) {
            const u64 e = lane + 32 * i;
            if (e < a.dv) o[i] += p * to_acc(v[j * v_row + e]);
        }
    }
    const acc_t inv = (acc_t)1 / l;
    const u64 at = a.src_off[a.slot] + ((b * chunks + c) * a.heads + h) * (a.dv + 1);
    for (u32 i = 0; i < a.ndst; ++i) {
        acc_t* rec = (acc_t*)a.recv[i] + at;
#pragma unroll
        for (int r = 0; r < FD_REGS; ++r) {
            const u64 e = lane + 32 * r;
            if (e < a.dv) rec[e] = o[r] * inv;
        }
        if (lane == 0) rec[a.dv] = m + ACC_LOG(l);
    }
    __syncwarp();
}

// One second-phase task on one warp: row t = (b, h) of the output and of the log-sum-exp.
__device__ void fd_combine(const FlashDecodeArgs& a, u64 t, u32 lane) {
    const u64 b = t / a.heads, h = t % a.heads;
    const acc_t* recv = (const acc_t*)a.recv[0];
    acc_t acc[FD_REGS];
#pragma unroll
    for (int i = 0; i < FD_REGS; ++i) acc[i] = 0;
    acc_t top = ACC_NEG_INF, sum = 0;
    for (u32 src = 0; src < a.nsrc; ++src) {
        for (u64 c = 0; c < a.chunks[src]; ++c) {
            const acc_t* rec = recv + a.src_off[src] + ((b * a.chunks[src] + c) * a.heads + h) * (a.dv + 1);
            const acc_t part = rec[a.dv];
            if (part == ACC_NEG_INF) continue;
            const acc_t next = ACC_MAX(top, part);
            const acc_t old = ACC_EXP(top - next), w = ACC_EXP(part - next);
            sum = sum * old + w;
#pragma unroll
            for (int i = 0; i < FD_REGS; ++i) {
                const u64 e = lane + 32 * i;
                if (e < a.dv) acc[i] = acc[i] * old + rec[e] * w;
            }
            top = next;
        }
    }
    const acc_t inv = sum > 0 ? (acc_t)1 / sum : (acc_t)0;
    elem_t* out = (elem_t*)a.out + t * a.dv;
#pragma unroll
    for (int i = 0; i < FD_REGS; ++i) {
        const u64 e = lane + 32 * i;
        if (e < a.dv) out[e] = from_acc(acc[i] * inv);
    }
    if (lane == 0) ((acc_t*)a.lse)[t] = top + ACC_LOG(sum);
}

extern "C" __global__ void __launch_bounds__(FD_WARPS * 32) dt_flash_decode(const __grid_constant__ FlashDecodeArgs a) {
    __shared__ acc_t qs[FD_WARPS][FD_MAX_D];
    __shared__ acc_t sc[FD_WARPS][FD_CHUNK];
    __shared__ int ok;
    const u32 lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const u64 warp = (u64)blockIdx.x * FD_WARPS + w, nwarps = (u64)gridDim.x * FD_WARPS;
    if (a.mode != 2) {
        const u64 total = a.batch * a.heads * a.chunks[a.slot];
        for (u64 t = warp; t < total; t += nwarps) fd_partial(a, t, lane, qs[w], sc[w]);
    }
    if (a.mode == 0) return;
    if (a.mode == 1) {
        const Sync& s = a.sync;
        __syncthreads();
        if (threadIdx.x == 0) {
            ok = 1;
            __threadfence_system();
            const u32 finished = atomicAdd((u32*)s.counter, 1u);
            if (finished == gridDim.x - 1) {
                // Every block's records are written: tell every rank, this one too.
                *(volatile u32*)s.counter = 0;
                __threadfence_system();
                for (u32 i = 0; i < s.world; ++i) {
                    const u32 p = (s.rank + i) % s.world;
                    st_release_sys(((u64*)s.ready_peer[p]) + s.rank, s.epoch);
                }
            }
            // Every source, this rank too (so that the counter's reset is seen before the
            // finish below counts on it again).
            for (u32 i = 0; i < s.world && ok; ++i) {
                const u32 src = (s.rank + i) % s.world;
                if (!dt_wait_ge(a.ctl, ((const u64*)s.ready) + src, src, s.epoch)) ok = 0;
            }
        }
        __syncthreads();
        if (!ok) return;
    }
    for (u64 t = warp; t < a.batch * a.heads; t += nwarps) fd_combine(a, t, lane);
    if (a.mode == 1) dt_finish(a.ctl, a.sync, true);
}
