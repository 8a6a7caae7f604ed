// Local math on one GPU tensor (no peers): elementwise ops with scalars and broadcasting,
// activations, casts, softmax, normalizations, reductions and axis permutations.
//
// Every element is widened to acc_t (f32 for f16 / bf16), computed there and rounded once, as the
// host does. Elementwise kernels move 16-byte vectors (cuMemAlloc buffers are 256-byte aligned,
// and tensors always start at their buffer), several a thread in chunks, then the tail one by
// one. Row kernels (softmax, norms, sums over the last axis) give one block per row, walked
// grid-stride over rows; softmax and the norms keep a row that fits in registers.

#define DT_NEG_INF (-__int_as_float(0x7f800000))
// f16 / bf16: the activations take the MUFU intrinsics (__expf: a few f32 ulp; the results
// round to 8 or 11 bits, and the tests' bound is 16 f32 ulp on top of that rounding); f32 and
// f64 keep the accurate library functions.
#define DT_HALF (DT_ELEM >= 2)

// ---- elementwise, one input ----

__device__ __forceinline__ acc_t op_neg(acc_t x, acc_t) { return -x; }
__device__ __forceinline__ acc_t op_relu(acc_t x, acc_t) { return x > (acc_t)0 ? x : (acc_t)0; }
#if DT_HALF
// x / (1 + e^-x) with a MUFU exp and a MUFU divide: where e^-x overflows to inf (or passes
// 2^126, where __fdividef gives 0) the result is +-0 within the tolerance (the host's is below
// 1e-36), and -inf / inf is NaN as on the host.
__device__ __forceinline__ acc_t op_silu(acc_t x, acc_t) {
    return __fdividef(x, 1.0f + __expf(-x));
}
// 0.5 x (1 + tanh(y)) is x * sigmoid(2y): the same value without the cancellation of 1 + tanh
// for negative y, and one MUFU exp instead of tanhf.
__device__ __forceinline__ acc_t op_gelu_tanh(acc_t x, acc_t) {
    const acc_t c = 0.7978845608028654f, k = 0.044715f;
    return __fdividef(x, 1.0f + __expf(-2.0f * (c * (x + k * x * x * x))));
}
#else
__device__ __forceinline__ acc_t op_silu(acc_t x, acc_t) { return x / ((acc_t)1 + exp(-x)); }
__device__ __forceinline__ acc_t op_gelu_tanh(acc_t x, acc_t) {
    const acc_t c = (acc_t)0.7978845608028654, k = (acc_t)0.044715;
    return (acc_t)0.5 * x * ((acc_t)1 + tanh(c * (x + k * x * x * x)));
}
#endif
__device__ __forceinline__ acc_t op_add_s(acc_t x, acc_t s) { return x + s; }
__device__ __forceinline__ acc_t op_sub_s(acc_t x, acc_t s) { return x - s; }
__device__ __forceinline__ acc_t op_mul_s(acc_t x, acc_t s) { return x * s; }
__device__ __forceinline__ acc_t op_div_s(acc_t x, acc_t s) { return x / s; }
__device__ __forceinline__ acc_t op_rsub_s(acc_t x, acc_t s) { return s - x; }
__device__ __forceinline__ acc_t op_rdiv_s(acc_t x, acc_t s) { return s / x; }

// The exact GELU, x * Phi(x). f32 and f64: erf in the accumulator type (erff is within 2 ulp;
// in f64 on one H200 it took 4.9x the memory roofline at [8192, 8192] bf16). The half types:
// phi_half (common.cuh), with MUFU instructions: erff held [8192, 8192] bf16 at 1.31x the
// roofline, this at 1.24x (silu 1.10x: the polynomial's multiply-adds are what is left).
#if DT_HALF
__device__ __forceinline__ acc_t op_gelu(acc_t x, acc_t) { return x * phi_half(x); }
#else
__device__ __forceinline__ acc_t op_gelu(acc_t x, acc_t) {
    return (acc_t)0.5 * x * ((acc_t)1 + erf(x * (acc_t)0.70710678118654752440));
}
#endif

// Blocks take chunks of DT_UNROLL * 256 vectors, one contiguous span, each thread DT_UNROLL
// vectors 256 apart, all loaded before any is computed: 64 bytes a thread in flight. On one
// H200 ([8192, 8192] bf16) one vector a thread, grid-stride over a grid of one wave, moved silu
// at 1.26x the copy roofline and add at 1.09x; these chunks at 1.11x and 1.03x. The grid is a
// block per chunk (grid-stride beyond the launch's limit); the tail of fewer than a vector is
// walked element by element.
#define DT_UNARY(name, expr)                                                                    \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        name(elem_t* __restrict__ out, const elem_t* __restrict__ x, u64 n, double scalar) {  \
        const acc_t s = (acc_t)scalar;                                                         \
        (void)s;                                                                               \
        const u64 nv = n / DT_VEC, span = (u64)DT_UNROLL * blockDim.x;                         \
        for (u64 chunk = blockIdx.x; chunk * span < nv; chunk += gridDim.x) {                  \
            const u64 base = chunk * span + threadIdx.x;                                       \
            Vec16 a[DT_UNROLL];                                                                \
            _Pragma("unroll") for (int h = 0; h < DT_UNROLL; h++) {                            \
                const u64 i = base + (u64)h * blockDim.x;                                      \
                if (i < nv) a[h] = ((const Vec16*)x)[i];                                       \
            }                                                                                  \
            _Pragma("unroll") for (int h = 0; h < DT_UNROLL; h++) {                            \
                const u64 i = base + (u64)h * blockDim.x;                                      \
                if (i < nv) {                                                                  \
                    Vec16 r;                                                                   \
                    _Pragma("unroll") for (int j = 0; j < (int)DT_VEC; j++) {                  \
                        const elem_t e = a[h].v[j];                                            \
                        r.v[j] = (expr);                                                       \
                    }                                                                          \
                    ((Vec16*)out)[i] = r;                                                      \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        const u64 stride = (u64)gridDim.x * blockDim.x;                                        \
        for (u64 i = nv * DT_VEC + (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;          \
             i += stride) {                                                                    \
            const elem_t e = x[i];                                                             \
            out[i] = (expr);                                                                   \
        }                                                                                      \
    }

DT_UNARY(dt_neg, from_acc(op_neg(to_acc(e), s)))
DT_UNARY(dt_relu, from_acc(op_relu(to_acc(e), s)))
DT_UNARY(dt_silu, from_acc(op_silu(to_acc(e), s)))
DT_UNARY(dt_gelu_tanh, from_acc(op_gelu_tanh(to_acc(e), s)))
DT_UNARY(dt_gelu, from_acc(op_gelu(to_acc(e), s)))
DT_UNARY(dt_add_s, from_acc(op_add_s(to_acc(e), s)))
DT_UNARY(dt_sub_s, from_acc(op_sub_s(to_acc(e), s)))
DT_UNARY(dt_mul_s, from_acc(op_mul_s(to_acc(e), s)))
DT_UNARY(dt_div_s, from_acc(op_div_s(to_acc(e), s)))
DT_UNARY(dt_rsub_s, from_acc(op_rsub_s(to_acc(e), s)))
DT_UNARY(dt_rdiv_s, from_acc(op_rdiv_s(to_acc(e), s)))

// ---- a bias along the last dimension, then an activation: out = f(round(x + b)) ----

// x: rows of `cols` elements (any leading dimensions), b: [cols], cols a whole number of vectors
// and the tensor fewer than 2^32 vectors (the host checks, and otherwise adds and activates in
// two passes). The sum is rounded to the element type before the activation, as the two passes
// round it, so the results are the same bits. One pass instead of two, and the sum is never
// stored: the backward pass (train.cu's DT_BIAS_ACT_GRAD) recomputes it. Chunks as DT_UNARY;
// a thread's bias vector index follows its vectors (blockDim.x apart) without a division each.
#define DT_BIAS_ACT(name, f)                                                                   \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        name(elem_t* __restrict__ out, const elem_t* __restrict__ x,                            \
             const elem_t* __restrict__ bias, u64 n, u64 cols) {                                \
        const u32 nv = (u32)(n / DT_VEC), cv = (u32)(cols / DT_VEC);                           \
        const u32 span = DT_UNROLL * blockDim.x;                                                \
        for (u32 chunk = blockIdx.x; (u64)chunk * span < nv; chunk += gridDim.x) {              \
            const u32 base = chunk * span + threadIdx.x;                                        \
            Vec16 a[DT_UNROLL], b[DT_UNROLL];                                                   \
            u32 c = base % cv;                                                                  \
            _Pragma("unroll") for (int h = 0; h < DT_UNROLL; h++) {                             \
                const u32 i = base + h * blockDim.x;                                            \
                if (i < nv) {                                                                   \
                    a[h] = ((const Vec16*)x)[i];                                                \
                    b[h] = ((const Vec16*)bias)[c];                                             \
                }                                                                               \
                c += blockDim.x;                                                                \
                if (c >= cv) c %= cv;                                                           \
            }                                                                                   \
            _Pragma("unroll") for (int h = 0; h < DT_UNROLL; h++) {                             \
                const u32 i = base + h * blockDim.x;                                            \
                if (i < nv) {                                                                   \
                    Vec16 r;                                                                    \
                    _Pragma("unroll") for (int j = 0; j < (int)DT_VEC; j++) {                   \
                        const elem_t e = from_acc(to_acc(a[h].v[j]) + to_acc(b[h].v[j]));       \
                        r.v[j] = from_acc(f(to_acc(e), (acc_t)0));                              \
                    }                                                                           \
                    ((Vec16*)out)[i] = r;                                                       \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
    }

DT_BIAS_ACT(dt_bias_gelu, op_gelu)
DT_BIAS_ACT(dt_bias_gelu_tanh, op_gelu_tanh)
DT_BIAS_ACT(dt_bias_silu, op_silu)
DT_BIAS_ACT(dt_bias_relu, op_relu)

// ---- casts: from this file's element type to each of the four ----

// Each value widened exactly (f32, f16 and bf16 to f32; f64 stays) and rounded once to the
// target, as the host's from_f64 does. Steps of E elements, 16 bytes of the narrower type, so
// both the loads and the stores are whole 16-byte vectors (f32 -> bf16: two loads, one store),
// DT_UNROLL steps a thread in chunks as in DT_UNARY.
#if DT_ELEM == 1
typedef double wide_t;
__device__ __forceinline__ wide_t widen(elem_t x) { return x; }
#else
typedef float wide_t;
__device__ __forceinline__ wide_t widen(elem_t x) { return to_acc(x); }
#endif

__device__ __forceinline__ u16 round_f16(float v) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
}
__device__ __forceinline__ u16 round_f16(double v) {
    u16 h;
    asm("cvt.rn.f16.f64 %0, %1;" : "=h"(h) : "d"(v));
    return h;
}
__device__ __forceinline__ u16 round_bf16(float v) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
}
__device__ __forceinline__ u16 round_bf16(double v) {
#if __CUDA_ARCH__ >= 900
    u16 h;
    asm("cvt.rn.bf16.f64 %0, %1;" : "=h"(h) : "d"(v));
    return h;
#else
    return round_bf16((float)v);
#endif
}

#define DT_CAST(name, out_t, convert)                                                         \
    extern "C" __global__ void __launch_bounds__(256)                                        \
        name(out_t* __restrict__ out, const elem_t* __restrict__ x, u64 n) {                \
        constexpr int E = 16 / (sizeof(elem_t) < sizeof(out_t) ? sizeof(elem_t) : sizeof(out_t)); \
        struct alignas(16) In { elem_t v[E]; };                                              \
        struct alignas(16) Out { out_t v[E]; };                                              \
        const u64 stride = (u64)gridDim.x * blockDim.x;                                      \
        const u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;                            \
        const u64 nv = n / E, span = (u64)DT_UNROLL * blockDim.x;                            \
        for (u64 chunk = blockIdx.x; chunk * span < nv; chunk += gridDim.x) {               \
            const u64 base = chunk * span + threadIdx.x;                                     \
            In a[DT_UNROLL];                                                                 \
            _Pragma("unroll") for (int h = 0; h < DT_UNROLL; h++) {                          \
                const u64 i = base + (u64)h * blockDim.x;                                    \
                if (i < nv) a[h] = ((const In*)x)[i];                                        \
            }                                                                                \
            _Pragma("unroll") for (int h = 0; h < DT_UNROLL; h++) {                          \
                const u64 i = base + (u64)h * blockDim.x;                                    \
                if (i < nv) {                                                                \
                    Out r;                                                                   \
                    _Pragma("unroll") for (int j = 0; j < E; j++) {                          \
                        const wide_t v = widen(a[h].v[j]);                                   \
                        r.v[j] = convert;                                                    \
                    }                                                                        \
                    ((Out*)out)[i] = r;                                                      \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        for (u64 i = nv * E + t; i < n; i += stride) {                                       \
            const wide_t v = widen(x[i]);                                                    \
            out[i] = convert;                                                                \
        }                                                                                    \
    }

DT_CAST(dt_cast_f32, float, (float)v)
DT_CAST(dt_cast_f64, double, (double)v)
DT_CAST(dt_cast_f16, u16, round_f16(v))
DT_CAST(dt_cast_bf16, u16, round_bf16(v))

// ---- elementwise, two inputs, broadcast ----

#define DT_MAX_DIMS 8

// Output dimensions (merged where both inputs allow), and each input's stride per dimension in
// elements (0 where it is broadcast). `flat`: both inputs have the output's shape.
struct BinaryArgs {
    u64 out, a, b, n;
    u64 shape[DT_MAX_DIMS];
    u64 sa[DT_MAX_DIMS];
    u64 sb[DT_MAX_DIMS];
    u32 ndim, flat;
    // Walk 16-byte vectors of the output: the last dimension is a whole number of vectors and
    // each input is contiguous (stride 1) or broadcast (stride 0) along it, with the other
    // strides whole vectors, so a vector's inputs are a vector each, or one element.
    u32 vec;
};

__device__ __forceinline__ acc_t op_add(acc_t x, acc_t y) { return x + y; }
__device__ __forceinline__ acc_t op_sub(acc_t x, acc_t y) { return x - y; }
__device__ __forceinline__ acc_t op_mul(acc_t x, acc_t y) { return x * y; }
__device__ __forceinline__ acc_t op_div(acc_t x, acc_t y) { return x / y; }

// Both inputs of the output's shape, fewer than 2^32 vectors of them: a kernel of its own, apart
// from the strided walks (DT_BINARY), whose registers lowered its occupancy. Blocks of
// DT_FLAT_BLOCK threads (the host launches that many; the kernel reads blockDim), each thread two
// 16-byte vector pairs a block apart, both loaded before either is computed, 32-bit indices; a
// block per 2 * DT_FLAT_BLOCK vectors, the last block also walking the tail of fewer than a
// vector. Bounded for blocks of 1024 (at most 64 registers), as benches/gpu/variants.cu's
// kernel: the same body bounded for 128 (`DT_FLAT_BLOCK` a constant) ran 0.2 to 0.8 us (0.4%) a
// call slower on an add of [8192, 8192] bf16 (one H200 and one H100, 2026-12-05; so did a copy
// of it taking its arguments plainly: the bound, not the argument struct, made the difference);
// bounded for 1024, within 0.3% of torch's add on the H100 (gpu_report --add beside
// torch_peer.py --add).
#define DT_FLAT_BLOCK 128
#define DT_BINARY_FLAT(name, f)                                                               \
    extern "C" __global__ void __launch_bounds__(1024)                                        \
        name(const __grid_constant__ BinaryArgs p) {                                          \
        elem_t* out = (elem_t*)p.out;                                                         \
        const elem_t* a = (const elem_t*)p.a;                                                 \
        const elem_t* b = (const elem_t*)p.b;                                                 \
        const u32 nv = (u32)(p.n / DT_VEC);                                                   \
        const u32 base = blockIdx.x * 2 * blockDim.x + threadIdx.x;                           \
        Vec16 x[2], y[2];                                                                     \
        _Pragma("unroll") for (int h = 0; h < 2; h++) {                                       \
            const u32 i = base + h * blockDim.x;                                              \
            if (i < nv) {                                                                     \
                x[h] = ((const Vec16*)a)[i];                                                  \
                y[h] = ((const Vec16*)b)[i];                                                  \
            }                                                                                 \
        }                                                                                     \
        _Pragma("unroll") for (int h = 0; h < 2; h++) {                                       \
            const u32 i = base + h * blockDim.x;                                              \
            if (i < nv) {                                                                     \
                Vec16 r;                                                                      \
                _Pragma("unroll") for (int j = 0; j < (int)DT_VEC; j++) r.v[j] =              \
                    from_acc(f(to_acc(x[h].v[j]), to_acc(y[h].v[j])));                        \
                ((Vec16*)out)[i] = r;                                                         \
            }                                                                                 \
        }                                                                                     \
        if (blockIdx.x == gridDim.x - 1)                                                      \
            for (u64 i = (u64)nv * DT_VEC + threadIdx.x; i < p.n; i += blockDim.x)            \
                out[i] = from_acc(f(to_acc(a[i]), to_acc(b[i])));                             \
    }

// Inputs broadcast or strided (`flat` is 0): each output element (or vector) finds its inputs.
#define DT_BINARY(name, f)                                                                    \
    extern "C" __global__ void __launch_bounds__(256) name(const __grid_constant__ BinaryArgs p) { \
        elem_t* out = (elem_t*)p.out;                                                         \
        const elem_t* a = (const elem_t*)p.a;                                                 \
        const elem_t* b = (const elem_t*)p.b;                                                 \
        const u64 stride = (u64)gridDim.x * blockDim.x;                                       \
        const u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;                             \
        if (p.vec) {                                                                          \
            const int last = (int)p.ndim - 1;                                                 \
            for (u64 i = t; i < p.n / DT_VEC; i += stride) {                                  \
                u64 rest = i * DT_VEC, ia = 0, ib = 0;                                        \
                for (int d = last; d >= 0; d--) {                                             \
                    const u64 c = rest % p.shape[d];                                          \
                    rest /= p.shape[d];                                                       \
                    ia += c * p.sa[d];                                                        \
                    ib += c * p.sb[d];                                                        \
                }                                                                             \
                Vec16 x, y, r;                                                                \
                if (p.sa[last]) x = *(const Vec16*)(a + ia);                                  \
                else _Pragma("unroll") for (int j = 0; j < (int)DT_VEC; j++) x.v[j] = a[ia];  \
                if (p.sb[last]) y = *(const Vec16*)(b + ib);                                  \
                else _Pragma("unroll") for (int j = 0; j < (int)DT_VEC; j++) y.v[j] = b[ib];  \
                _Pragma("unroll") for (int j = 0; j < (int)DT_VEC; j++) r.v[j] =              \
                    from_acc(f(to_acc(x.v[j]), to_acc(y.v[j])));                              \
                ((Vec16*)out)[i] = r;                                                         \
            }                                                                                 \
            return;                                                                           \
        }                                                                                     \
        for (u64 i = t; i < p.n; i += stride) {                                               \
            u64 rest = i, ia = 0, ib = 0;                                                     \
            for (int d = (int)p.ndim - 1; d >= 0; d--) {                                      \
                const u64 c = rest % p.shape[d];                                              \
                rest /= p.shape[d];                                                           \
                ia += c * p.sa[d];                                                            \
                ib += c * p.sb[d];                                                            \
            }                                                                                 \
            out[i] = from_acc(f(to_acc(a[ia]), to_acc(b[ib])));                               \
        }                                                                                     \
    }

DT_BINARY(dt_add, op_add)
DT_BINARY(dt_sub, op_sub)
DT_BINARY(dt_mul, op_mul)
DT_BINARY(dt_div, op_div)
DT_BINARY_FLAT(dt_add_flat, op_add)
DT_BINARY_FLAT(dt_sub_flat, op_sub)
DT_BINARY_FLAT(dt_mul_flat, op_mul)
DT_BINARY_FLAT(dt_div_flat, op_div)

// ---- permutation of axes: out[i] = x[offset of i's coordinates under the input strides] ----

struct PermuteArgs {
    u64 out, x, n;
    u64 shape[DT_MAX_DIMS];  // the output's shape
    u64 sx[DT_MAX_DIMS];     // the input's stride for each output axis
    u32 ndim;
};

extern "C" __global__ void __launch_bounds__(256) dt_permute(const __grid_constant__ PermuteArgs p) {
    elem_t* out = (elem_t*)p.out;
    const elem_t* x = (const elem_t*)p.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += stride) {
        u64 rest = i, ix = 0;
        for (int d = (int)p.ndim - 1; d >= 0; d--) {
            const u64 c = rest % p.shape[d];
            rest /= p.shape[d];
            ix += c * p.sx[d];
        }
        out[i] = x[ix];
    }
}

// [batch, rows, cols] -> [batch, cols, rows], through a square tile in shared memory, so that
// both the reads and the writes are coalesced. Blocks of 32 x 8 threads; tasks are tiles. Tiles
// of 64 (32 for f64) give each thread 16 loads in flight (a 32-tile of bf16 gave 4 and ran at
// 3.1x the copy roofline on one H200). Rows of the tile are padded to a 4-byte multiple plus one
// word, so that a warp reading a column of it hits 32 different banks.
#define DT_TILE (sizeof(elem_t) == 8 ? 32 : 64)
#define DT_TILE_PAD (sizeof(elem_t) == 2 ? 2 : 1)

extern "C" __global__ void __launch_bounds__(256)
    dt_transpose(elem_t* __restrict__ out, const elem_t* __restrict__ x, u64 batch, u64 rows,
                 u64 cols) {
    __shared__ elem_t tile[DT_TILE][DT_TILE + DT_TILE_PAD];
    const u64 tr = (rows + DT_TILE - 1) / DT_TILE, tc = (cols + DT_TILE - 1) / DT_TILE;
    const u64 tasks = batch * tr * tc;
    const u32 tx = threadIdx.x % 32, ty = threadIdx.x / 32;
    if (sizeof(elem_t) == 2 && rows % 2 == 0 && cols % 2 == 0) {
        // 2-byte elements in pairs (4-byte loads and stores, 128 bytes a warp): even lengths
        // keep every pair inside the matrix and 4-byte aligned. A lane reads columns 2 tx and
        // 2 tx + 1 of a tile row, and writes rows 2 tx and 2 tx + 1 of a tile column.
        for (u64 task = blockIdx.x; task < tasks; task += gridDim.x) {
            const u64 bi = task / (tr * tc), rem = task % (tr * tc);
            const u64 r0 = (rem / tc) * DT_TILE, c0 = (rem % tc) * DT_TILE;
            const elem_t* src = x + bi * rows * cols;
            elem_t* dst = out + bi * rows * cols;
#pragma unroll
            for (u32 jj = 0; jj < DT_TILE; jj += 8) {
                const u32 j = jj + ty;
                const u64 r = r0 + j, c = c0 + 2 * tx;
                if (r < rows && c < cols) {
                    *(u32*)&tile[j][2 * tx] = *(const u32*)&src[r * cols + c];
                }
            }
            __syncthreads();
#pragma unroll
            for (u32 jj = 0; jj < DT_TILE; jj += 8) {
                const u32 j = jj + ty;
                const u64 c = c0 + j, r = r0 + 2 * tx;
                if (r < rows && c < cols) {
                    const u32 lo = *(const u16*)&tile[2 * tx][j];
                    const u32 hi = *(const u16*)&tile[2 * tx + 1][j];
                    *(u32*)&dst[c * rows + r] = lo | (hi << 16);
                }
            }
            __syncthreads();
        }
        return;
    }
    for (u64 task = blockIdx.x; task < tasks; task += gridDim.x) {
        const u64 bi = task / (tr * tc), rem = task % (tr * tc);
        const u64 r0 = (rem / tc) * DT_TILE, c0 = (rem % tc) * DT_TILE;
        const elem_t* src = x + bi * rows * cols;
        elem_t* dst = out + bi * rows * cols;
#pragma unroll
        for (u32 jj = 0; jj < DT_TILE; jj += 8) {
#pragma unroll
            for (u32 ii = 0; ii < DT_TILE; ii += 32) {
                const u32 j = jj + ty, i = ii + tx;
                const u64 r = r0 + j, c = c0 + i;
                if (r < rows && c < cols) tile[j][i] = src[r * cols + c];
            }
        }
        __syncthreads();
#pragma unroll
        for (u32 jj = 0; jj < DT_TILE; jj += 8) {
#pragma unroll
            for (u32 ii = 0; ii < DT_TILE; ii += 32) {
                const u32 j = jj + ty, i = ii + tx;
                const u64 c = c0 + j, r = r0 + i;
                if (r < rows && c < cols) dst[c * rows + r] = tile[i][j];
            }
        }
        __syncthreads();
    }
}

// ---- block reductions ----

__device__ __forceinline__ acc_t block_sum(acc_t v, acc_t* scratch) {
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : (acc_t)0;
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// fmax ignores NaN: a NaN entry reaches the result through the sum of exponentials instead.
__device__ __forceinline__ acc_t block_max(acc_t v, acc_t* scratch) {
    for (int o = 16; o > 0; o /= 2) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : (acc_t)DT_NEG_INF;
    for (int o = 16; o > 0; o /= 2) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Lanes of `n` elements, `inner` apart: lane (o, i) starts at o * n * inner + i. One block per
// lane, grid-stride over lanes.
struct LaneArgs {
    u64 out, x, w, b;
    u64 outer, n, inner;
    double eps;
    u32 mode;  // softmax: unused; norms: bit 0 weight, bit 1 bias; sums: 1 = mean
};

// ---- rows kept in registers ----
//
// A row of up to DT_ROW_CACHE * 256 elements (8192; 4096 in f64) is read once into registers,
// DT_ROW_CACHE accumulator values a thread, then reduced and written from there: one read and
// one write of the row instead of two or three reads. Where the row length is a multiple of a
// 16-byte vector (VEC) slot k of a thread holds vector threadIdx.x + k * 256 of the row, else
// element threadIdx.x + i * 256 sits in slot i. (Keeping the row in the element type instead,
// 16 registers for a bf16 row, with the exponentials computed twice, was slower on one H200:
// softmax of [16384, 8192] bf16 at 1.94x the copy roofline against 1.30x.)
#define DT_ROW_CACHE (sizeof(acc_t) == 8 ? 16 : 32)
#define DT_ROW_THREADS 256

// Whether cache slot i of this thread holds an element of a row of n.
template <bool VEC>
__device__ __forceinline__ bool row_has(int i, u64 n) {
    if (VEC) return ((u64)threadIdx.x + (u64)(i / (int)DT_VEC) * DT_ROW_THREADS) * DT_VEC < n;
    return (u64)threadIdx.x + (u64)i * DT_ROW_THREADS < n;
}

template <bool VEC>
__device__ __forceinline__ void load_row(acc_t (&c)[DT_ROW_CACHE], const elem_t* __restrict__ xr,
                                         u64 n, acc_t pad) {
    if (VEC) {
#pragma unroll
        for (int k = 0; k < (int)(DT_ROW_CACHE / DT_VEC); k++) {
            const u64 vi = (u64)threadIdx.x + (u64)k * DT_ROW_THREADS;
            if (vi * DT_VEC < n) {
                const Vec16 a = ((const Vec16*)xr)[vi];
#pragma unroll
                for (int j = 0; j < (int)DT_VEC; j++) c[k * DT_VEC + j] = to_acc(a.v[j]);
            } else {
#pragma unroll
                for (int j = 0; j < (int)DT_VEC; j++) c[k * DT_VEC + j] = pad;
            }
        }
    } else {
#pragma unroll
        for (int i = 0; i < (int)DT_ROW_CACHE; i++) {
            const u64 e = (u64)threadIdx.x + (u64)i * DT_ROW_THREADS;
            c[i] = e < n ? to_acc(xr[e]) : pad;
        }
    }
}

template <bool VEC>
__device__ __forceinline__ void store_row(elem_t* __restrict__ outr,
                                          const acc_t (&c)[DT_ROW_CACHE], u64 n) {
    if (VEC) {
#pragma unroll
        for (int k = 0; k < (int)(DT_ROW_CACHE / DT_VEC); k++) {
            const u64 vi = (u64)threadIdx.x + (u64)k * DT_ROW_THREADS;
            if (vi * DT_VEC < n) {
                Vec16 r;
#pragma unroll
                for (int j = 0; j < (int)DT_VEC; j++) r.v[j] = from_acc(c[k * DT_VEC + j]);
                ((Vec16*)outr)[vi] = r;
            }
        }
    } else {
#pragma unroll
        for (int i = 0; i < (int)DT_ROW_CACHE; i++) {
            const u64 e = (u64)threadIdx.x + (u64)i * DT_ROW_THREADS;
            if (e < n) outr[e] = from_acc(c[i]);
        }
    }
}

#if DT_HALF
__device__ __forceinline__ acc_t row_exp(acc_t x) { return __expf(x); }
#else
__device__ __forceinline__ acc_t row_exp(acc_t x) { return exp(x); }
#endif

// Softmax of rows of n (inner = 1) that fit the cache: max, then exp(x - max) kept in place and
// summed, then scaled by 1 / sum. NaN anywhere makes the sum NaN; +inf makes max +inf and
// inf - inf NaN; a row all -inf has max -inf and NaN everywhere; a -inf among finite entries
// gives exp(-inf) = 0: what the host gives. Padding is -inf, which adds 0 (or NaN in the rows
// that are NaN anyway).
template <bool VEC>
__device__ __forceinline__ void softmax_rows(const LaneArgs& p, acc_t* scratch) {
    elem_t* out = (elem_t*)p.out;
    const elem_t* x = (const elem_t*)p.x;
    for (u64 row = blockIdx.x; row < p.outer; row += gridDim.x) {
        acc_t c[DT_ROW_CACHE];
        load_row<VEC>(c, x + row * p.n, p.n, (acc_t)DT_NEG_INF);
        acc_t m = (acc_t)DT_NEG_INF;
#pragma unroll
        for (int i = 0; i < (int)DT_ROW_CACHE; i++) m = fmax(m, c[i]);
        m = block_max(m, scratch);
        acc_t s = 0;
#pragma unroll
        for (int i = 0; i < (int)DT_ROW_CACHE; i++) {
            c[i] = row_has<VEC>(i, p.n) ? row_exp(c[i] - m) : (acc_t)0;
            s += c[i];
        }
        const acc_t r = (acc_t)1 / block_sum(s, scratch);
#pragma unroll
        for (int i = 0; i < (int)DT_ROW_CACHE; i++) c[i] *= r;
        store_row<VEC>(out + row * p.n, c, p.n);
    }
}

// rms_norm / layer_norm of rows that fit the cache, in the order of operations of dt_norm.
template <bool VEC>
__device__ __forceinline__ void norm_rows(const LaneArgs& p, acc_t* scratch) {
    elem_t* out = (elem_t*)p.out;
    const elem_t* x = (const elem_t*)p.x;
    const elem_t* w = (const elem_t*)p.w;
    const elem_t* b = (const elem_t*)p.b;
    const bool layer = p.mode & 4, has_w = p.mode & 1, has_b = p.mode & 2;
    const acc_t count = (acc_t)p.n, eps = (acc_t)p.eps;
    for (u64 row = blockIdx.x; row < p.outer; row += gridDim.x) {
        acc_t c[DT_ROW_CACHE];
        load_row<VEC>(c, x + row * p.n, p.n, (acc_t)0);
        acc_t mean = 0;
        if (layer) {
            acc_t s = 0;
#pragma unroll
            for (int i = 0; i < (int)DT_ROW_CACHE; i++) s += c[i];
            mean = block_sum(s, scratch) / count;
        }
        acc_t q = 0;
#pragma unroll
        for (int i = 0; i < (int)DT_ROW_CACHE; i++) {
            const acc_t v = c[i] - mean;
            if (row_has<VEC>(i, p.n)) q += v * v;
        }
        const acc_t scale = (acc_t)1 / sqrt(block_sum(q, scratch) / count + eps);
        elem_t* outr = out + row * p.n;
        if (VEC) {
#pragma unroll
            for (int k = 0; k < (int)(DT_ROW_CACHE / DT_VEC); k++) {
                const u64 vi = (u64)threadIdx.x + (u64)k * DT_ROW_THREADS;
                if (vi * DT_VEC < p.n) {
                    Vec16 wv, bv, r;
                    if (has_w) wv = ((const Vec16*)w)[vi];
                    if (has_b) bv = ((const Vec16*)b)[vi];
#pragma unroll
                    for (int j = 0; j < (int)DT_VEC; j++) {
                        acc_t v = (c[k * DT_VEC + j] - mean) * scale;
                        if (has_w) v = v * to_acc(wv.v[j]);
                        if (has_b) v = v + to_acc(bv.v[j]);
                        r.v[j] = from_acc(v);
                    }
                    ((Vec16*)outr)[vi] = r;
                }
            }
        } else {
#pragma unroll
            for (int i = 0; i < (int)DT_ROW_CACHE; i++) {
                const u64 e = (u64)threadIdx.x + (u64)i * DT_ROW_THREADS;
                if (e < p.n) {
                    acc_t v = (c[i] - mean) * scale;
                    if (has_w) v = v * to_acc(w[e]);
                    if (has_b) v = v + to_acc(b[e]);
                    outr[e] = from_acc(v);
                }
            }
        }
    }
}

// The (max, sum of exp(x - max)) pair of softmax, combined; a part whose max is -inf holds no
// mass (so -inf entries give 0), while NaN and +inf give NaN as on the host.
__device__ __forceinline__ acc_t mass_at(acc_t m, acc_t s, acc_t to) {
    return m == (acc_t)DT_NEG_INF ? (acc_t)0 : s * exp(m - to);
}

__device__ __forceinline__ void block_max_sum(acc_t& m, acc_t& s, acc_t* scratch) {
    for (int o = 16; o > 0; o /= 2) {
        const acc_t m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const acc_t s2 = __shfl_xor_sync(0xffffffffu, s, o);
        const acc_t top = fmax(m, m2);
        s = mass_at(m, s, top) + mass_at(m2, s2, top);
        m = top;
    }
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    __syncthreads();
    if (lane == 0) {
        scratch[2 * warp] = m;
        scratch[2 * warp + 1] = s;
    }
    __syncthreads();
    m = lane < warps ? scratch[2 * lane] : (acc_t)DT_NEG_INF;
    s = lane < warps ? scratch[2 * lane + 1] : (acc_t)0;
    for (int o = 16; o > 0; o /= 2) {
        const acc_t m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const acc_t s2 = __shfl_xor_sync(0xffffffffu, s, o);
        const acc_t top = fmax(m, m2);
        s = mass_at(m, s, top) + mass_at(m2, s2, top);
        m = top;
    }
}

// Rows kept in registers have kernels of their own, apart from the general ones below, so that
// the general path's registers do not lower their occupancy: on one H200, [16384, 8192] bf16
// rms_norm inside dt_norm ran at 1.40x the copy roofline, alone (63 registers, four blocks a
// multiprocessor) at 1.17x; layer_norm 1.53x -> 1.25x, softmax 1.30x -> 1.17x. The host launches them for rows of at most DT_ROW_CACHE * 256 over
// the last axis (`row_cache` in local.rs), with 256 threads; _vec where a row is whole vectors.
#define DT_ROWS_KERNEL(name, body, vec)                                                        \
    extern "C" __global__ void __launch_bounds__(DT_ROW_THREADS)                              \
        name(const __grid_constant__ LaneArgs p) {                                            \
        __shared__ acc_t scratch[64];                                                          \
        body<vec>(p, scratch);                                                                 \
    }
DT_ROWS_KERNEL(dt_softmax_rows_vec, softmax_rows, true)
DT_ROWS_KERNEL(dt_softmax_rows, softmax_rows, false)
DT_ROWS_KERNEL(dt_norm_rows_vec, norm_rows, true)
DT_ROWS_KERNEL(dt_norm_rows, norm_rows, false)

// Longer lanes, or lanes along an inner axis: the online (max, sum) pair over two reads.
extern "C" __global__ void __launch_bounds__(256) dt_softmax(const __grid_constant__ LaneArgs p) {
    __shared__ acc_t scratch[64];
    elem_t* out = (elem_t*)p.out;
    const elem_t* x = (const elem_t*)p.x;
    for (u64 lane = blockIdx.x; lane < p.outer * p.inner; lane += gridDim.x) {
        const u64 base = (lane / p.inner) * p.n * p.inner + lane % p.inner;
        acc_t m = (acc_t)DT_NEG_INF, s = 0;
        for (u64 j = threadIdx.x; j < p.n; j += blockDim.x) {
            const acc_t v = to_acc(x[base + j * p.inner]);
            const acc_t top = fmax(m, v);
            s = mass_at(m, s, top) + (v == (acc_t)DT_NEG_INF ? (acc_t)0 : exp(v - top));
            m = top;
        }
        block_max_sum(m, s, scratch);
        for (u64 j = threadIdx.x; j < p.n; j += blockDim.x) {
            const u64 at = base + j * p.inner;
            out[at] = from_acc(exp(to_acc(x[at]) - m) / s);
        }
    }
}

// rms_norm (mode bit 2 clear) and layer_norm (bit 2 set) over rows of `n` (inner = 1) longer
// than the register cache (dt_norm_rows): two reads (three for layer_norm).
extern "C" __global__ void __launch_bounds__(256) dt_norm(const __grid_constant__ LaneArgs p) {
    __shared__ acc_t scratch[64];
    elem_t* out = (elem_t*)p.out;
    const elem_t* x = (const elem_t*)p.x;
    const elem_t* w = (const elem_t*)p.w;
    const elem_t* b = (const elem_t*)p.b;
    const bool layer = p.mode & 4;
    const acc_t count = (acc_t)p.n, eps = (acc_t)p.eps;
    for (u64 row = blockIdx.x; row < p.outer; row += gridDim.x) {
        const elem_t* xr = x + row * p.n;
        acc_t mean = 0;
        if (layer) {
            acc_t s = 0;
            for (u64 j = threadIdx.x; j < p.n; j += blockDim.x) s += to_acc(xr[j]);
            mean = block_sum(s, scratch) / count;
        }
        acc_t q = 0;
        for (u64 j = threadIdx.x; j < p.n; j += blockDim.x) {
            const acc_t v = to_acc(xr[j]) - mean;
            q += v * v;
        }
        const acc_t scale = (acc_t)1 / sqrt(block_sum(q, scratch) / count + eps);
        for (u64 j = threadIdx.x; j < p.n; j += blockDim.x) {
            acc_t v = (to_acc(xr[j]) - mean) * scale;
            if (p.mode & 1) v = v * to_acc(w[j]);
            if (p.mode & 2) v = v + to_acc(b[j]);
            out[row * p.n + j] = from_acc(v);
        }
    }
}

// The sum (or mean) of a whole tensor of `inner` elements, first pass: chunk c (of `outer`
// chunks of `n` elements, the last one shorter) summed by one block into partial[c], in the
// accumulator type. Fixed chunks, so the order of the sums depends on the sizes only.
extern "C" __global__ void __launch_bounds__(256) dt_sum_chunks(const __grid_constant__ LaneArgs p) {
    __shared__ acc_t scratch[64];
    acc_t* partial = (acc_t*)p.out;
    const elem_t* x = (const elem_t*)p.x;
    for (u64 c = blockIdx.x; c < p.outer; c += gridDim.x) {
        const u64 start = c * p.n, end = min(start + p.n, p.inner);
        acc_t s = 0;
        for (u64 j = start + threadIdx.x; j < end; j += blockDim.x) s += to_acc(x[j]);
        s = block_sum(s, scratch);
        if (threadIdx.x == 0) partial[c] = s;
    }
}

// Second pass: one block sums the `outer` partials into out[0] (divided by `inner` for a mean).
extern "C" __global__ void __launch_bounds__(256) dt_sum_partials(const __grid_constant__ LaneArgs p) {
    __shared__ acc_t scratch[64];
    const acc_t* partial = (const acc_t*)p.x;
    acc_t s = 0;
    for (u64 j = threadIdx.x; j < p.outer; j += blockDim.x) s += partial[j];
    s = block_sum(s, scratch);
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        ((elem_t*)p.out)[0] = from_acc(p.mode == 1 ? s / (acc_t)p.inner : s);
    }
}

// Sums (or means) over rows of `n` (inner = 1): one block per row, grid-stride over rows.
extern "C" __global__ void __launch_bounds__(256) dt_sum(const __grid_constant__ LaneArgs p) {
    __shared__ acc_t scratch[64];
    elem_t* out = (elem_t*)p.out;
    const elem_t* x = (const elem_t*)p.x;
    const acc_t count = (acc_t)p.n;
    for (u64 row = blockIdx.x; row < p.outer; row += gridDim.x) {
        acc_t s = 0;
        for (u64 j = threadIdx.x; j < p.n; j += blockDim.x) s += to_acc(x[row * p.n + j]);
        s = block_sum(s, scratch);
        if (threadIdx.x == 0) out[row] = from_acc(p.mode == 1 ? s / count : s);
    }
}

// Sums (or means) over lanes of `n` elements `inner` apart (inner > 1: the columns of a
// row-major matrix, as a bias's gradient sums), in two passes so that the whole GPU reads: block
// (tile, chunk) adds rows [chunk * rows, (chunk + 1) * rows) of 32 neighbouring lanes (32 threads
// across, 8 down, a partial per thread, then the 8 in order) into partial[chunk][lane]; then one
// thread per lane adds its chunks' partials in order. Fixed chunks: the order of the sums depends
// on the sizes only. (One thread per lane over all n, as before, left most of the GPU idle: a
// bias gradient over [8192, 16384] bf16 took 1.5 ms on one H200.)
struct ColumnArgs {
    u64 out, x, partial;
    u64 outer, n, inner;
    u64 rows, chunks;
    u32 mode;  // 1 = mean
};

extern "C" __global__ void __launch_bounds__(256) dt_sum_columns(const __grid_constant__ ColumnArgs p) {
    __shared__ acc_t part[8][33];
    const elem_t* x = (const elem_t*)p.x;
    acc_t* partial = (acc_t*)p.partial;
    const u64 tiles = (p.inner + 31) / 32, lanes = p.outer * p.inner;
    const u32 tx = threadIdx.x % 32, ty = threadIdx.x / 32;
    for (u64 blk = blockIdx.x; blk < p.outer * tiles * p.chunks; blk += gridDim.x) {
        const u64 chunk = blk % p.chunks, tile = blk / p.chunks;
        const u64 o = tile / tiles, i = (tile % tiles) * 32 + tx;
        const u64 start = chunk * p.rows, end = min(start + p.rows, p.n);
        acc_t s = 0;
        if (i < p.inner) {
            const elem_t* column = x + o * p.n * p.inner + i;
#pragma unroll 4
            for (u64 j = start + ty; j < end; j += 8) s += to_acc(column[j * p.inner]);
        }
        part[ty][tx] = s;
        __syncthreads();
        if (ty == 0 && i < p.inner) {
            acc_t t = 0;
            for (int r = 0; r < 8; r++) t += part[r][tx];
            partial[chunk * lanes + o * p.inner + i] = t;
        }
        __syncthreads();
    }
}

// dt_sum_columns where `inner` is a whole number of 16-byte vectors: a thread adds a vector of
// DT_VEC neighbouring lanes (a warp 32 * DT_VEC lanes across, 8 warps down), in the same order as
// dt_sum_columns (rows ty, ty + 8, ..., then the 8 partials in order). Two-byte loads, 64 bytes
// a warp, held a [8192, 16384] bf16 bias gradient at 0.23 ms on one H200; this, 0.084 ms (torch
// 0.075 ms).
extern "C" __global__ void __launch_bounds__(256)
    dt_sum_columns_vec(const __grid_constant__ ColumnArgs p) {
    const u64 width = 32 * DT_VEC;
    __shared__ acc_t part[8][32 * DT_VEC + 1];
    const elem_t* x = (const elem_t*)p.x;
    acc_t* partial = (acc_t*)p.partial;
    const u64 tiles = (p.inner + width - 1) / width, lanes = p.outer * p.inner;
    const u32 tx = threadIdx.x % 32, ty = threadIdx.x / 32;
    for (u64 blk = blockIdx.x; blk < p.outer * tiles * p.chunks; blk += gridDim.x) {
        const u64 chunk = blk % p.chunks, tile = blk / p.chunks;
        const u64 o = tile / tiles, i0 = (tile % tiles) * width, i = i0 + tx * DT_VEC;
        const u64 start = chunk * p.rows, end = min(start + p.rows, p.n);
        acc_t s[DT_VEC];
#pragma unroll
        for (int j = 0; j < (int)DT_VEC; j++) s[j] = 0;
        if (i < p.inner) {
            const elem_t* column = x + o * p.n * p.inner + i;
#pragma unroll 4
            for (u64 r = start + ty; r < end; r += 8) {
                const Vec16 v = *(const Vec16*)(column + r * p.inner);
#pragma unroll
                for (int j = 0; j < (int)DT_VEC; j++) s[j] += to_acc(v.v[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < (int)DT_VEC; j++) part[ty][tx * DT_VEC + j] = s[j];
        __syncthreads();
        for (u64 l = threadIdx.x; l < width; l += blockDim.x) {
            if (i0 + l < p.inner) {
                acc_t t = 0;
                for (int r = 0; r < 8; r++) t += part[r][l];
                partial[chunk * lanes + o * p.inner + i0 + l] = t;
            }
        }
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(256)
    dt_sum_columns_partials(const __grid_constant__ ColumnArgs p) {
    elem_t* out = (elem_t*)p.out;
    const acc_t* partial = (const acc_t*)p.partial;
    const u64 lanes = p.outer * p.inner, stride = (u64)gridDim.x * blockDim.x;
    for (u64 lane = (u64)blockIdx.x * blockDim.x + threadIdx.x; lane < lanes; lane += stride) {
        acc_t s = 0;
        for (u64 c = 0; c < p.chunks; c++) s += partial[c * lanes + lane];
        out[lane] = from_acc(p.mode == 1 ? s / (acc_t)p.n : s);
    }
}
