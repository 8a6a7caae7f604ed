// Shared by every dist-tensor CUDA kernel: element types, system-scope signals, bounded waits.
//
// The host compiles each kernel file with NVRTC after prepending `#define DT_ELEM <n>` (0 f32,
// 1 f64, 2 f16, 3 bf16) and this header. Kernels follow the seed's conventions: a program is a
// block, tasks are flattened and walked grid-stride, peers are visited as (rank + i) % world,
// masks (bounds checks) instead of padding, and one thread of a block does the signalling.

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

#define DT_MAX_RANKS 8

#if DT_ELEM == 0
typedef float elem_t;
typedef float acc_t;
__device__ __forceinline__ acc_t to_acc(elem_t x) { return x; }
__device__ __forceinline__ elem_t from_acc(acc_t x) { return x; }
#elif DT_ELEM == 1
typedef double elem_t;
typedef double acc_t;
__device__ __forceinline__ acc_t to_acc(elem_t x) { return x; }
__device__ __forceinline__ elem_t from_acc(acc_t x) { return x; }
#elif DT_ELEM == 2
typedef u16 elem_t;
typedef float acc_t;
__device__ __forceinline__ acc_t to_acc(elem_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}
__device__ __forceinline__ elem_t from_acc(acc_t x) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
#elif DT_ELEM == 3
typedef u16 elem_t;
typedef float acc_t;
__device__ __forceinline__ acc_t to_acc(elem_t x) { return __uint_as_float(((u32)x) << 16); }
__device__ __forceinline__ elem_t from_acc(acc_t x) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
#else
#error "DT_ELEM must be 0 (f32), 1 (f64), 2 (f16) or 3 (bf16)"
#endif

// Widening to f64 and rounding back once, for what computes in f64 (the exact GELU, the
// activations' derivatives), as the host does.
__device__ __forceinline__ double to_f64(elem_t x) { return (double)to_acc(x); }

__device__ __forceinline__ elem_t from_f64(double x) {
#if DT_ELEM == 1
    return x;
#elif DT_ELEM == 0
    return (float)x;
#elif DT_ELEM == 2
    u16 h;
    asm("cvt.rn.f16.f64 %0, %1;" : "=h"(h) : "d"(x));
    return h;
#elif __CUDA_ARCH__ >= 900
    u16 h;
    asm("cvt.rn.bf16.f64 %0, %1;" : "=h"(h) : "d"(x));
    return h;
#else
    return from_acc((float)x);
#endif
}

// 16-byte vectors of elements, what the elementwise kernels of local.cu and train.cu move
// (cuMemAlloc buffers are 256-byte aligned, and tensors always start at their buffer).
#define DT_VEC (16 / sizeof(elem_t))
struct alignas(16) Vec16 {
    elem_t v[DT_VEC];
};

// Vectors a thread of a chunked elementwise kernel takes, all loaded before any is computed.
#define DT_UNROLL 4

// The body of an elementwise kernel of two inputs of `n` elements: out[i] = expr, where expr
// reads e0 = a[i] and e1 = b[i] (elem_t). Blocks take chunks of DT_UNROLL * blockDim.x vector
// pairs, each thread DT_UNROLL pairs blockDim.x apart, all loaded before any is computed (on one
// H200 silu moved at 1.11x the copy roofline so, against 1.26x for a vector a thread over a wave
// of resident blocks); the grid is a block per chunk, walked grid-stride past the launch's cap;
// the tail of fewer than a vector element by element.
#define DT_ZIP_CHUNKS(out, a, b, n, expr)                                                     \
    do {                                                                                      \
        const u64 nv_ = (n) / DT_VEC, span_ = (u64)DT_UNROLL * blockDim.x;                    \
        for (u64 chunk_ = blockIdx.x; chunk_ * span_ < nv_; chunk_ += gridDim.x) {            \
            const u64 base_ = chunk_ * span_ + threadIdx.x;                                   \
            Vec16 av_[DT_UNROLL], bv_[DT_UNROLL];                                             \
            _Pragma("unroll") for (int h_ = 0; h_ < DT_UNROLL; h_++) {                        \
                const u64 i_ = base_ + (u64)h_ * blockDim.x;                                  \
                if (i_ < nv_) {                                                               \
                    av_[h_] = ((const Vec16*)(a))[i_];                                        \
                    bv_[h_] = ((const Vec16*)(b))[i_];                                        \
                }                                                                             \
            }                                                                                 \
            _Pragma("unroll") for (int h_ = 0; h_ < DT_UNROLL; h_++) {                        \
                const u64 i_ = base_ + (u64)h_ * blockDim.x;                                  \
                if (i_ < nv_) {                                                               \
                    Vec16 r_;                                                                 \
                    _Pragma("unroll") for (int j_ = 0; j_ < (int)DT_VEC; j_++) {              \
                        const elem_t e0 = av_[h_].v[j_], e1 = bv_[h_].v[j_];                  \
                        r_.v[j_] = (expr);                                                    \
                    }                                                                         \
                    ((Vec16*)(out))[i_] = r_;                                                 \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        const u64 stride_ = (u64)gridDim.x * blockDim.x;                                      \
        for (u64 i_ = nv_ * DT_VEC + (u64)blockIdx.x * blockDim.x + threadIdx.x; i_ < (n);    \
             i_ += stride_) {                                                                 \
            const elem_t e0 = (a)[i_], e1 = (b)[i_];                                          \
            (out)[i_] = (expr);                                                               \
        }                                                                                     \
    } while (0)

#if DT_ELEM >= 2
// The MUFU reciprocal and base-2 exponential (flush-to-zero, as __expf and __fdividef use them),
// written out so that no range handling around them is compiled in.
__device__ __forceinline__ float rcp_approx(float x) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ float ex2_approx(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// The normal CDF Phi(x) for the exact GELU and its derivative in the half types, in f32: through
// erfc(z) = t exp(-z^2 + P(t)), z = |x| / sqrt 2, t = 1 / (1 + z / 2) (the Chebyshev fit of
// Numerical Recipes' erfcc: relative error under 1.2e-7 for every z, so the tail x < 0 keeps
// its digits as erfcf does), with the MUFU reciprocal and exponential. The exponential's
// constants are folded into the fit: erfc(z) / 2 = t 2^(P'(t) - x^2 log2(e) / 2), P' = P log2(e)
// - 1. On one H200 ([8192, 8192] bf16, benches/gpu/variants.py) the GELU ran at 1.11x the copy
// roofline so, against 1.27x through __expf and __fdividef, whose range handling compiled in
// (both exactly rounded against f64 on every element). NaN gives NaN; -inf gives 0 and +inf 1,
// as erf does.
__device__ __forceinline__ float phi_half(float x) {
    const float l2e = 1.4426950408889634f;
    const float a = fabsf(x);
    const float t = rcp_approx(fmaf(0.35355339059327376f, a, 1.0f));
    float p = 0.17087277f * l2e;
    p = fmaf(p, t, -0.82215223f * l2e);
    p = fmaf(p, t, 1.48851587f * l2e);
    p = fmaf(p, t, -1.13520398f * l2e);
    p = fmaf(p, t, 0.27886807f * l2e);
    p = fmaf(p, t, -0.18628806f * l2e);
    p = fmaf(p, t, 0.09678418f * l2e);
    p = fmaf(p, t, 0.37409196f * l2e);
    p = fmaf(p, t, 1.00002368f * l2e);
    p = fmaf(p, t, -1.26551223f * l2e - 1.0f);
    const float half_erfc = t * ex2_approx(fmaf(a * (-0.5f * l2e), a, p));
    return x >= 0.0f ? 1.0f - half_erfc : half_erfc;
}
#endif

// grad_t: what the training kernels' derivatives and norm gradients compute in: f64 for f32 and
// f64 (the host's f64, so f32 results round as the host's do), f32 for the half types (whose one
// rounding to 8 or 11 bits hides f32's few ulp).
#if DT_ELEM <= 1
typedef double grad_t;
__device__ __forceinline__ elem_t from_grad(grad_t x) { return from_f64(x); }
#else
typedef float grad_t;
__device__ __forceinline__ elem_t from_grad(grad_t x) { return from_acc(x); }
#endif
__device__ __forceinline__ grad_t to_grad(elem_t x) { return (grad_t)to_acc(x); }

// Where a kernel reports a failed wait, and how it learns that the world failed.
struct Ctl {
    u64 abort;       // u32 in host-mapped memory, shared by the world: non-zero once anything failed
    u64 fault;       // u64[8] in host-mapped memory, this rank's fault record
    u64 claim;       // u32 in device memory: the first failing wait of this rank claims the record
    u64 timeout_ns;  // how long a wait gives its peer
    u32 rank;
    u32 op;          // which op is waiting, for the record
};

// The signals and the pointer table a kernel that talks to its peers uses (symmetric memory).
struct Sync {
    u64 epoch;                        // this call's number; signals carry it and are never reset
    u64 table;                        // u64[world]: pointers peers published to this rank
    u64 table_peer[DT_MAX_RANKS];     // symm_at(table, p)
    u64 ready;                        // u64[world]: ready[src] = epoch once src published
    u64 ready_peer[DT_MAX_RANKS];     // symm_at(ready, p)
    u64 done;                         // u64[world]: done[src] = epoch once src finished with us
    u64 done_peer[DT_MAX_RANKS];      // symm_at(done, p)
    u64 counter;                      // u32 in local device memory: blocks finished
    u32 rank;
    u32 world;
};

__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ u64 ld_relaxed_sys(const u64* p) {
    u64 v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ u64 now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ bool world_aborted(const Ctl& c) {
    return *(volatile const u32*)c.abort != 0;
}

// Records a failed wait in this rank's fault record (the first one wins) and fails the world:
// every other wait, on every GPU, then gives up. Never traps (a trap would poison the context).
__device__ void dt_fail_wait(const Ctl& c, u32 signal, u64 want, u64 seen) {
    if (atomicCAS((u32*)c.claim, 0u, 1u) == 0u) {
        volatile u64* f = (volatile u64*)c.fault;
        f[1] = c.rank;
        f[2] = blockIdx.x;
        f[3] = signal;
        f[4] = want;
        f[5] = seen;
        f[7] = c.op;
        __threadfence_system();
        f[6] = 1;
    }
    *(volatile u32*)c.abort = 1;
    __threadfence_system();
}

// Waits until *sig >= want (acquire, system scope). Returns false when the world failed or the
// wait timed out (then the fault record names rank, program, signal and values).
__device__ bool dt_wait_ge(const Ctl& c, const u64* sig, u32 signal, u64 want) {
    u64 seen = ld_acquire_sys(sig);
    if (seen >= want) return true;
    const u64 start = now_ns();
    u32 backoff = 32;
    u32 spins = 0;
    for (;;) {
        seen = ld_acquire_sys(sig);
        if (seen >= want) return true;
        // The abort word is host memory (a bus round trip): look at it every few spins.
        if ((++spins & 15) == 0) {
            if (world_aborted(c)) return false;
            if (now_ns() - start > c.timeout_ns) {
                dt_fail_wait(c, signal, want, seen);
                return false;
            }
        }
        __nanosleep(backoff);
        if (backoff < 512) backoff *= 2;
    }
}

// Publishes `mine` (a pointer) to every peer and waits until every peer published to us; fills
// ptrs[i] with the pointer of rank (rank + i) % world. Run by every block: thread 0 signals and
// waits, the block then reads the pointers. Returns false if the world failed.
__device__ bool dt_publish_and_wait(const Ctl& c, const Sync& s, u64 mine, u64* ptrs) {
    __shared__ int ok;
    if (threadIdx.x == 0) {
        ok = 1;
        ptrs[0] = mine;
        for (u32 i = 1; i < s.world; ++i) {
            const u32 p = (s.rank + i) % s.world;
            ((volatile u64*)s.table_peer[p])[s.rank] = mine;
            st_release_sys(((u64*)s.ready_peer[p]) + s.rank, s.epoch);
        }
        for (u32 i = 1; i < s.world && ok; ++i) {
            const u32 src = (s.rank + i) % s.world;
            if (!dt_wait_ge(c, ((const u64*)s.ready) + src, src, s.epoch)) {
                ok = 0;
            } else {
                ptrs[i] = ld_relaxed_sys(((const u64*)s.table) + src);
            }
        }
    }
    __syncthreads();
    return ok != 0;
}

// Waits (thread 0 of each block) until every peer has published this epoch, without publishing.
__device__ bool dt_wait_ready(const Ctl& c, const Sync& s) {
    __shared__ int ok;
    if (threadIdx.x == 0) {
        ok = 1;
        for (u32 i = 1; i < s.world && ok; ++i) {
            const u32 src = (s.rank + i) % s.world;
            if (!dt_wait_ge(c, ((const u64*)s.ready) + src, src, s.epoch)) ok = 0;
        }
    }
    __syncthreads();
    return ok != 0;
}

// Called by every block when its tasks are done. The last block to finish tells every peer
// `done` (all of this rank's reads from and writes to the peer are complete) and, when
// `wait_peers`, waits until every peer said the same to us, so the kernel ends only once no peer
// still touches this rank's memory.
__device__ void dt_finish(const Ctl& c, const Sync& s, bool wait_peers) {
    __syncthreads();
    if (threadIdx.x != 0) return;
    __threadfence_system();
    const u32 finished = atomicAdd((u32*)s.counter, 1u);
    if (finished != gridDim.x - 1) return;
    *(volatile u32*)s.counter = 0;  // every block has counted: ready for the next launch
    __threadfence_system();
    for (u32 i = 1; i < s.world; ++i) {
        const u32 p = (s.rank + i) % s.world;
        st_release_sys(((u64*)s.done_peer[p]) + s.rank, s.epoch);
    }
    if (!wait_peers) return;
    for (u32 i = 1; i < s.world; ++i) {
        const u32 src = (s.rank + i) % s.world;
        if (!dt_wait_ge(c, ((const u64*)s.done) + src, DT_MAX_RANKS + src, s.epoch)) return;
    }
}

// Contiguous runs of elements: run q of a part is (p0, ia, p1) = decompose(q) with
// q = (p0 * a + ia) * p1n + p1; its source and destination offsets are linear in those.
// Long runs are cut into chunks of `chunk` elements, one task each.
struct Runs {
    u64 count;    // runs in this part
    u64 a;
    u64 p1n;
    u64 len;      // elements per run
    u64 chunk;    // elements per task (a multiple of 16 bytes)
    u64 chunks;   // tasks per run: ceil(len / chunk), at least 1
    u64 s0, sa, s1, sbase;
    u64 d0, da, d1, dbase;
};

__device__ __forceinline__ void run_offsets(const Runs& r, u64 q, u64* so, u64* doff) {
    const u64 p1 = q % r.p1n;
    q /= r.p1n;
    const u64 ia = q % r.a;
    const u64 p0 = q / r.a;
    *so = r.sbase + p0 * r.s0 + ia * r.sa + p1 * r.s1;
    *doff = r.dbase + p0 * r.d0 + ia * r.da + p1 * r.d1;
}
