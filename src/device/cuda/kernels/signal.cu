// Stream-side signals: one thread waits for signals, then sets others (system-scope release).
// Used between a copy engine's transfer and a cuBLASLt product, where no tile kernel of ours runs.

struct SignalArgs {
    Ctl ctl;
    u64 want;                    // wait until every wait[i] >= want
    u64 value;                   // then set every notify[i] = value
    u32 n_wait;
    u32 n_notify;
    u64 wait[DT_MAX_RANKS];
    u64 wait_index[DT_MAX_RANKS];
    u64 notify[DT_MAX_RANKS];
};

extern "C" __global__ void dt_signal(const __grid_constant__ SignalArgs a) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    for (u32 i = 0; i < a.n_wait; ++i) {
        if (!dt_wait_ge(a.ctl, (const u64*)a.wait[i], (u32)a.wait_index[i], a.want)) return;
    }
    __threadfence_system();
    for (u32 i = 0; i < a.n_notify; ++i) st_release_sys((u64*)a.notify[i], a.value);
}

// Fills `out` with values drawn uniformly from [-1, 1) by a counter-based hash of (seed, index):
// the same seed gives the same tensor on any grid.
extern "C" __global__ void dt_fill_random(elem_t* out, u64 n, u64 seed) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        u64 z = seed + 0x9E3779B97F4A7C15ull * (i + 1);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        const acc_t u = (acc_t)((double)(z >> 11) * (1.0 / 4503599627370496.0) - 1.0);
        out[i] = from_acc(u == (acc_t)0 ? (acc_t)0.5 : u);
    }
}
