// What training needs on one GPU tensor beyond the forward math: the activations' derivatives
// (the backward pass of gelu, gelu_tanh, silu and relu), mse_loss's gradient and sum of squares,
// and the optimizers' element updates (SGD with momentum and weight decay, Adam with decoupled
// weight decay), each one pass over the elements, grid-stride.
//
// The derivatives compute in grad_t and round once: f64 for f32 and f64, as the host does, and
// f32 for the half types, whose one rounding to 8 or 11 bits hides f32's few ulp (in f64, the
// exact GELU's derivative over [8192, 16384] bf16 took 1.09 ms on one H200). The optimizers
// compute in acc_t (f32 for f16 / bf16, as on the host); a half-type parameter is updated
// through its f32 master copy and rounded into the parameter once per step.

// ---- activation derivatives: out = dy * f'(x) ----

#if DT_ELEM >= 2
// f32: Phi through phi_half (common.cuh); the density with the accurate expf (it cancels Phi
// near x = -0.75, where the derivative is 0).
__device__ __forceinline__ grad_t d_gelu(grad_t x) {
    return phi_half(x) + x * expf(-0.5f * x * x) * 0.39894228040143267794f;
}
#else
__device__ __forceinline__ grad_t d_gelu(grad_t x) {
    const grad_t cdf = (grad_t)0.5 * ((grad_t)1 + erf(x * (grad_t)0.70710678118654752440));
    const grad_t pdf = exp((grad_t)-0.5 * x * x) * (grad_t)0.39894228040143267794;
    return cdf + x * pdf;
}
#endif

__device__ __forceinline__ grad_t d_gelu_tanh(grad_t x) {
    const grad_t c = (grad_t)0.7978845608028654, k = (grad_t)0.044715;
    const grad_t t = tanh(c * (x + k * x * x * x));
    return (grad_t)0.5 * ((grad_t)1 + t) +
           (grad_t)0.5 * x * ((grad_t)1 - t * t) * c * ((grad_t)1 + (grad_t)3 * k * x * x);
}

__device__ __forceinline__ grad_t d_silu(grad_t x) {
    const grad_t s = (grad_t)1 / ((grad_t)1 + exp(-x));
    return s * ((grad_t)1 + x * ((grad_t)1 - s));
}

__device__ __forceinline__ grad_t d_relu(grad_t x) { return x > (grad_t)0 ? (grad_t)1 : (grad_t)0; }

#define DT_ACT(x, dy, d) from_grad(to_grad(dy) * d(to_grad(x)))

// Chunks of vector pairs (DT_ZIP_CHUNKS, common.cuh; with the f32 Phi, the exact GELU's
// derivative over [8192, 16384] bf16 went 0.305 -> 0.255 ms on one H200).
#define DT_ACT_GRAD(name, d)                                                                  \
    extern "C" __global__ void __launch_bounds__(256)                                        \
        name(elem_t* __restrict__ out, const elem_t* __restrict__ x,                         \
             const elem_t* __restrict__ dy, u64 n) {                                         \
        DT_ZIP_CHUNKS(out, x, dy, n, DT_ACT(e0, e1, d));                                     \
    }

DT_ACT_GRAD(dt_gelu_grad, d_gelu)
DT_ACT_GRAD(dt_gelu_tanh_grad, d_gelu_tanh)
DT_ACT_GRAD(dt_silu_grad, d_silu)
DT_ACT_GRAD(dt_relu_grad, d_relu)

// ---- through a bias and an activation: out = dy * f'(round(x + b)) ----

// The backward pass of local.cu's DT_BIAS_ACT (same layout and checks): the sum x + b rounded
// as the forward rounded it (not stored), then DT_ACT, so the bits are those of the activation's
// derivative at the stored sum. Chunks of DT_UNROLL vector triples a thread.
#define DT_BIAS_ACT_GRAD(name, d)                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        name(elem_t* __restrict__ out, const elem_t* __restrict__ x,                            \
             const elem_t* __restrict__ bias, const elem_t* __restrict__ dy, u64 n, u64 cols) { \
        const u32 nv = (u32)(n / DT_VEC), cv = (u32)(cols / DT_VEC);                           \
        const u32 span = DT_UNROLL * blockDim.x;                                                \
        for (u32 chunk = blockIdx.x; (u64)chunk * span < nv; chunk += gridDim.x) {              \
            const u32 base = chunk * span + threadIdx.x;                                        \
            Vec16 a[DT_UNROLL], b[DT_UNROLL], g[DT_UNROLL];                                     \
            u32 c = base % cv;                                                                  \
            _Pragma("unroll") for (int h = 0; h < DT_UNROLL; h++) {                             \
                const u32 i = base + h * blockDim.x;                                            \
                if (i < nv) {                                                                   \
                    a[h] = ((const Vec16*)x)[i];                                                \
                    b[h] = ((const Vec16*)bias)[c];                                             \
                    g[h] = ((const Vec16*)dy)[i];                                               \
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
                        r.v[j] = DT_ACT(e, g[h].v[j], d);                                       \
                    }                                                                           \
                    ((Vec16*)out)[i] = r;                                                       \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
    }

DT_BIAS_ACT_GRAD(dt_bias_gelu_grad, d_gelu)
DT_BIAS_ACT_GRAD(dt_bias_gelu_tanh_grad, d_gelu_tanh)
DT_BIAS_ACT_GRAD(dt_bias_silu_grad, d_silu)
DT_BIAS_ACT_GRAD(dt_bias_relu_grad, d_relu)

// ---- mse_loss: grad = (p - t) * scale in acc_t, rounded once; sum of (p - t)^2 in f64 ----

// Chunk c (of `chunk` elements, a whole number of vectors; the last one shorter) is one block's:
// its gradient, and its sum of squares into partial[c]. Fixed chunks: the order of the sums
// depends on the sizes only. (As ten elementwise kernels and a sum it took 1.16 ms over
// [8192, 4096] bf16 on one H200.)
struct MseArgs {
    u64 grad, p, t, partial, n, chunk;
    double scale;
};

__device__ __forceinline__ double block_sum_f64(double v, double* scratch) {
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0;
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ elem_t mse_element(elem_t p, elem_t t, acc_t scale, double& s) {
    const acc_t pa = to_acc(p), ta = to_acc(t);
    const double d = (double)pa - (double)ta;
    s += d * d;
    return from_acc((pa - ta) * scale);
}

extern "C" __global__ void __launch_bounds__(256) dt_mse(const __grid_constant__ MseArgs a) {
    __shared__ double scratch[32];
    elem_t* g = (elem_t*)a.grad;
    const elem_t* p = (const elem_t*)a.p;
    const elem_t* t = (const elem_t*)a.t;
    const acc_t scale = (acc_t)a.scale;
    const u64 chunks = (a.n + a.chunk - 1) / a.chunk;
    for (u64 c = blockIdx.x; c < chunks; c += gridDim.x) {
        const u64 start = c * a.chunk, end = min(start + a.chunk, a.n);
        double s = 0.0;
        for (u64 v = start / DT_VEC + threadIdx.x; v < end / DT_VEC; v += blockDim.x) {
            const Vec16 pv = ((const Vec16*)p)[v], tv = ((const Vec16*)t)[v];
            Vec16 r;
#pragma unroll
            for (int j = 0; j < (int)DT_VEC; j++) r.v[j] = mse_element(pv.v[j], tv.v[j], scale, s);
            ((Vec16*)g)[v] = r;
        }
        for (u64 i = end / DT_VEC * DT_VEC + threadIdx.x; i < end; i += blockDim.x)
            g[i] = mse_element(p[i], t[i], scale, s);
        s = block_sum_f64(s, scratch);
        if (threadIdx.x == 0) ((double*)a.partial)[c] = s;
    }
}

// One block adds the `chunks` partials into out[0] (in an order fixed by their number).
extern "C" __global__ void __launch_bounds__(256)
    dt_mse_total(double* __restrict__ out, const double* __restrict__ partial, u64 chunks) {
    __shared__ double scratch[32];
    double s = 0.0;
    for (u64 c = threadIdx.x; c < chunks; c += blockDim.x) s += partial[c];
    s = block_sum_f64(s, scratch);
    if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = s;
}

// ---- optimizer steps ----

// `out` receives the new parameter (a fresh buffer: the old value may be shared); `master`
// (acc_t, or 0 when the parameter is its own master) is read and written in place, as are the
// state buffers `s0` (SGD's velocity, Adam's first moment) and `s1` (Adam's second moment).
struct OptArgs {
    u64 out, p, master, g, s0, s1, n;
    double lr;      // SGD: the learning rate; Adam: lr / (1 - beta1^t)
    double a;       // SGD: momentum; Adam: beta1
    double b;       // SGD: weight decay; Adam: beta2
    double eps;     // Adam
    double shrink;  // Adam: 1 - lr * weight decay
    double root;    // Adam: sqrt(1 - beta2^t)
    u32 mode;       // 0: SGD, 1: SGD with momentum, 2: Adam
};

// One element's update (the old value w, its gradient gi, its state m and v), in acc_t.
__device__ __forceinline__ void optim_update(const OptArgs& a, acc_t& w, acc_t gi, acc_t& m,
                                             acc_t& v) {
    const acc_t lr = (acc_t)a.lr, ca = (acc_t)a.a, cb = (acc_t)a.b, one = (acc_t)1;
    if (a.mode == 2) {
        m = ca * m + (one - ca) * gi;
        v = cb * v + (one - cb) * gi * gi;
        w = w * (acc_t)a.shrink - lr * m / (sqrt(v) / (acc_t)a.root + (acc_t)a.eps);
    } else {
        acc_t d = gi + cb * w;
        if (a.mode == 1) {
            d = ca * m + d;
            m = d;
        }
        w = w - lr * d;
    }
}

template <class E>
struct alignas(4 * sizeof(E)) Quad {
    E v[4];
};

// Four neighbouring elements a thread, each array read and written as one vector (buffers start
// 256-byte aligned), a grid of one pass (grid-stride past the launch's cap), then the tail one by
// one. On one H200 Adam over 4096 x 16384 bf16 (f32 master weights and moments: 28 bytes an
// element) ran at 1.15x the copy roofline with one element a thread over a wave of resident
// blocks, at 1.02x so. (Four elements a thread blockDim apart measured no faster; eight in two
// vectors an array, 1.27x.)
extern "C" __global__ void __launch_bounds__(256) dt_optim(const __grid_constant__ OptArgs a) {
    elem_t* out = (elem_t*)a.out;
    const elem_t* p = (const elem_t*)a.p;
    acc_t* master = (acc_t*)a.master;
    const elem_t* g = (const elem_t*)a.g;
    acc_t* s0 = (acc_t*)a.s0;
    acc_t* s1 = (acc_t*)a.s1;
    const bool first = a.mode != 0, second = a.mode == 2;
    const u64 stride = (u64)gridDim.x * blockDim.x, quads = a.n / 4;
    const u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    for (u64 q = t; q < quads; q += stride) {
        Quad<acc_t> w, m, v;
        const Quad<elem_t> gq = ((const Quad<elem_t>*)g)[q];
        if (master) {
            w = ((const Quad<acc_t>*)master)[q];
        } else {
            const Quad<elem_t> pq = ((const Quad<elem_t>*)p)[q];
#pragma unroll
            for (int j = 0; j < 4; j++) w.v[j] = to_acc(pq.v[j]);
        }
        if (first) m = ((const Quad<acc_t>*)s0)[q];
        if (second) v = ((const Quad<acc_t>*)s1)[q];
        Quad<elem_t> o;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            optim_update(a, w.v[j], to_acc(gq.v[j]), m.v[j], v.v[j]);
            o.v[j] = from_acc(w.v[j]);
        }
        if (master) ((Quad<acc_t>*)master)[q] = w;
        if (first) ((Quad<acc_t>*)s0)[q] = m;
        if (second) ((Quad<acc_t>*)s1)[q] = v;
        ((Quad<elem_t>*)out)[q] = o;
    }
    for (u64 i = quads * 4 + t; i < a.n; i += stride) {
        acc_t w = master ? master[i] : to_acc(p[i]);
        acc_t m = first ? s0[i] : (acc_t)0, v = second ? s1[i] : (acc_t)0;
        optim_update(a, w, to_acc(g[i]), m, v);
        if (master) master[i] = w;
        if (first) s0[i] = m;
        if (second) s1[i] = v;
        out[i] = from_acc(w);
    }
}
