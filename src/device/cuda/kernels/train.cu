// What training needs on one GPU tensor beyond the forward math: the activations' derivatives
// (the backward pass of gelu, gelu_tanh, silu and relu) and the optimizers' element updates (SGD
// with momentum and weight decay, Adam with decoupled weight decay), each one pass over the
// elements, grid-stride.
//
// The derivatives compute in f64 and round once, as the host does (`Tensor::*_backward`). The optimizers
// compute in acc_t (f32 for f16 / bf16, as on the host); a half-type parameter is updated through
// its f32 master copy and rounded into the parameter once per step.

// ---- activation derivatives: out = dy * f'(x) ----

__device__ __forceinline__ double d_gelu(double x) {
    const double cdf = 0.5 * (1.0 + erf(x * 0.70710678118654752440));
    const double pdf = exp(-0.5 * x * x) * 0.39894228040143267794;
    return cdf + x * pdf;
}

__device__ __forceinline__ double d_gelu_tanh(double x) {
    const double c = 0.7978845608028654, k = 0.044715;
    const double t = tanh(c * (x + k * x * x * x));
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * k * x * x);
}

__device__ __forceinline__ double d_silu(double x) {
    const double s = 1.0 / (1.0 + exp(-x));
    return s * (1.0 + x * (1.0 - s));
}

__device__ __forceinline__ double d_relu(double x) { return x > 0.0 ? 1.0 : 0.0; }

#define DT_ACT_GRAD(name, d)                                                                  \
    extern "C" __global__ void __launch_bounds__(256)                                        \
        name(elem_t* __restrict__ out, const elem_t* __restrict__ x,                         \
             const elem_t* __restrict__ dy, u64 n) {                                         \
        const u64 stride = (u64)gridDim.x * blockDim.x;                                      \
        for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)        \
            out[i] = from_f64(to_f64(dy[i]) * d(to_f64(x[i])));                              \
    }

DT_ACT_GRAD(dt_gelu_grad, d_gelu)
DT_ACT_GRAD(dt_gelu_tanh_grad, d_gelu_tanh)
DT_ACT_GRAD(dt_silu_grad, d_silu)
DT_ACT_GRAD(dt_relu_grad, d_relu)

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

extern "C" __global__ void __launch_bounds__(256) dt_optim(const __grid_constant__ OptArgs a) {
    elem_t* out = (elem_t*)a.out;
    const elem_t* p = (const elem_t*)a.p;
    acc_t* master = (acc_t*)a.master;
    const elem_t* g = (const elem_t*)a.g;
    acc_t* s0 = (acc_t*)a.s0;
    acc_t* s1 = (acc_t*)a.s1;
    const acc_t lr = (acc_t)a.lr, ca = (acc_t)a.a, cb = (acc_t)a.b, one = (acc_t)1;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < a.n; i += stride) {
        acc_t w = master ? master[i] : to_acc(p[i]);
        const acc_t gi = to_acc(g[i]);
        if (a.mode == 2) {
            const acc_t m = ca * s0[i] + (one - ca) * gi;
            const acc_t v = cb * s1[i] + (one - cb) * gi * gi;
            s0[i] = m;
            s1[i] = v;
            w = w * (acc_t)a.shrink - lr * m / (sqrt(v) / (acc_t)a.root + (acc_t)a.eps);
        } else {
            acc_t d = gi + cb * w;
            if (a.mode == 1) {
                d = ca * s0[i] + d;
                s0[i] = d;
            }
            w = w - lr * d;
        }
        if (master) master[i] = w;
        out[i] = from_acc(w);
    }
}
