// Local math on one GPU tensor (no peers): elementwise ops with scalars and broadcasting,
// activations, casts, softmax, normalizations, reductions and axis permutations.
//
// Every element is widened to acc_t (f32 for f16 / bf16), computed there and rounded once, as the
// host does; the exact GELU computes in f64 like the host's. Elementwise kernels walk the
// elements grid-stride in 16-byte vectors (cuMemAlloc buffers are 256-byte aligned, and tensors
// always start at their buffer), then the tail one by one. Row kernels (softmax, norms, sums
// over the last axis) give one block per row, walked grid-stride over rows.

#define DT_VEC (16 / sizeof(elem_t))
#define DT_NEG_INF (-__int_as_float(0x7f800000))

struct alignas(16) Vec16 {
    elem_t v[DT_VEC];
};

// ---- elementwise, one input ----

__device__ __forceinline__ acc_t op_neg(acc_t x, acc_t) { return -x; }
__device__ __forceinline__ acc_t op_relu(acc_t x, acc_t) { return x > (acc_t)0 ? x : (acc_t)0; }
__device__ __forceinline__ acc_t op_silu(acc_t x, acc_t) { return x / ((acc_t)1 + exp(-x)); }
__device__ __forceinline__ acc_t op_gelu_tanh(acc_t x, acc_t) {
    const acc_t c = (acc_t)0.7978845608028654, k = (acc_t)0.044715;
    return (acc_t)0.5 * x * ((acc_t)1 + tanh(c * (x + k * x * x * x)));
}
__device__ __forceinline__ acc_t op_add_s(acc_t x, acc_t s) { return x + s; }
__device__ __forceinline__ acc_t op_sub_s(acc_t x, acc_t s) { return x - s; }
__device__ __forceinline__ acc_t op_mul_s(acc_t x, acc_t s) { return x * s; }
__device__ __forceinline__ acc_t op_div_s(acc_t x, acc_t s) { return x / s; }
__device__ __forceinline__ acc_t op_rsub_s(acc_t x, acc_t s) { return s - x; }
__device__ __forceinline__ acc_t op_rdiv_s(acc_t x, acc_t s) { return s / x; }

// The exact GELU in the accumulator type (f32 for f32 and the half types: erff is within 2
// ulp, so the result rounds as the host's f64 one does within the dtype's tolerance; in f64 on
// one H200 it took 4.9x the memory roofline at [8192, 8192] bf16).
__device__ __forceinline__ acc_t op_gelu(acc_t x, acc_t) {
    return (acc_t)0.5 * x * ((acc_t)1 + erf(x * (acc_t)0.70710678118654752440));
}

#define DT_UNARY(name, expr)                                                                    \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        name(elem_t* __restrict__ out, const elem_t* __restrict__ x, u64 n, double scalar) {  \
        const acc_t s = (acc_t)scalar;                                                         \
        (void)s;                                                                               \
        const u64 stride = (u64)gridDim.x * blockDim.x;                                        \
        const u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;                              \
        const u64 nv = n / DT_VEC;                                                             \
        for (u64 i = t; i < nv; i += stride) {                                                 \
            Vec16 a = ((const Vec16*)x)[i];                                                    \
            Vec16 r;                                                                           \
            _Pragma("unroll") for (int j = 0; j < (int)DT_VEC; j++) {                          \
                const elem_t e = a.v[j];                                                       \
                r.v[j] = (expr);                                                               \
            }                                                                                  \
            ((Vec16*)out)[i] = r;                                                              \
        }                                                                                      \
        for (u64 i = nv * DT_VEC + t; i < n; i += stride) {                                    \
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

// ---- casts: from this file's element type to each of the four ----

#define DT_CAST(name, out_t, convert)                                                         \
    extern "C" __global__ void __launch_bounds__(256)                                        \
        name(out_t* __restrict__ out, const elem_t* __restrict__ x, u64 n) {                \
        const u64 stride = (u64)gridDim.x * blockDim.x;                                      \
        for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {      \
            const double v = to_f64(x[i]);                                                   \
            out[i] = convert;                                                                \
        }                                                                                    \
    }

__device__ __forceinline__ u16 f64_to_f16(double v) {
    u16 h;
    asm("cvt.rn.f16.f64 %0, %1;" : "=h"(h) : "d"(v));
    return h;
}
__device__ __forceinline__ u16 f64_to_bf16(double v) {
#if __CUDA_ARCH__ >= 900
    u16 h;
    asm("cvt.rn.bf16.f64 %0, %1;" : "=h"(h) : "d"(v));
    return h;
#else
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"((float)v));
    return h;
#endif
}

DT_CAST(dt_cast_f32, float, (float)v)
DT_CAST(dt_cast_f64, double, v)
DT_CAST(dt_cast_f16, u16, f64_to_f16(v))
DT_CAST(dt_cast_bf16, u16, f64_to_bf16(v))

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

#define DT_BINARY(name, f)                                                                    \
    extern "C" __global__ void __launch_bounds__(256) name(const __grid_constant__ BinaryArgs p) { \
        elem_t* out = (elem_t*)p.out;                                                         \
        const elem_t* a = (const elem_t*)p.a;                                                 \
        const elem_t* b = (const elem_t*)p.b;                                                 \
        const u64 stride = (u64)gridDim.x * blockDim.x;                                       \
        const u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;                             \
        if (p.flat) {                                                                         \
            const u64 nv = p.n / DT_VEC;                                                      \
            for (u64 i = t; i < nv; i += stride) {                                            \
                Vec16 x = ((const Vec16*)a)[i], y = ((const Vec16*)b)[i], r;                  \
                _Pragma("unroll") for (int j = 0; j < (int)DT_VEC; j++) r.v[j] =              \
                    from_acc(f(to_acc(x.v[j]), to_acc(y.v[j])));                              \
                ((Vec16*)out)[i] = r;                                                         \
            }                                                                                 \
            for (u64 i = nv * DT_VEC + t; i < p.n; i += stride)                               \
                out[i] = from_acc(f(to_acc(a[i]), to_acc(b[i])));                             \
            return;                                                                           \
        }                                                                                     \
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

// [batch, rows, cols] -> [batch, cols, rows], through a 32 x 33 tile in shared memory, so that
// both the reads and the writes are coalesced. Blocks of 32 x 8 threads; tasks are tiles.
extern "C" __global__ void __launch_bounds__(256)
    dt_transpose(elem_t* __restrict__ out, const elem_t* __restrict__ x, u64 batch, u64 rows,
                 u64 cols) {
    __shared__ elem_t tile[32][33];
    const u64 tr = (rows + 31) / 32, tc = (cols + 31) / 32;
    const u64 tasks = batch * tr * tc;
    const u32 tx = threadIdx.x % 32, ty = threadIdx.x / 32;
    for (u64 task = blockIdx.x; task < tasks; task += gridDim.x) {
        const u64 bi = task / (tr * tc), rem = task % (tr * tc);
        const u64 r0 = (rem / tc) * 32, c0 = (rem % tc) * 32;
        const elem_t* src = x + bi * rows * cols;
        elem_t* dst = out + bi * rows * cols;
        for (u32 j = ty; j < 32; j += 8) {
            const u64 r = r0 + j, c = c0 + tx;
            if (r < rows && c < cols) tile[j][tx] = src[r * cols + c];
        }
        __syncthreads();
        for (u32 j = ty; j < 32; j += 8) {
            const u64 c = c0 + j, r = r0 + tx;
            if (r < rows && c < cols) dst[c * rows + r] = tile[tx][j];
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

// Lanes of `n` elements, `inner` apart: lane (o, i) starts at o * n * inner + i. One block per
// lane, grid-stride over lanes.
struct LaneArgs {
    u64 out, x, w, b;
    u64 outer, n, inner;
    double eps;
    u32 mode;  // softmax: unused; norms: bit 0 weight, bit 1 bias; sums: 1 = mean
};

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

// rms_norm (mode bit 2 clear) and layer_norm (bit 2 set) over rows of `n` (inner = 1).
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
