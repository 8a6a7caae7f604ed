//! What this machine is and what it can do: the CPU as `/proc/cpuinfo` describes it, and its
//! measured peak FLOP/s and memory bandwidth (the roofline every row is compared with).

use std::hint::black_box;
use std::sync::Barrier;
use std::time::Instant;

use dist_tensor::device::tile;
use dist_tensor::shmem::{GlobalPtr, GlobalPtrMut};

/// The CPU as the operating system describes it.
pub struct Cpu {
    pub model: String,
    /// `family F model M` where the CPU reports them.
    pub id: String,
    /// Logical processors listed, and how many this process may use.
    pub listed: usize,
    pub usable: usize,
    /// The widest vector extensions the CPU reports, widest first.
    pub simd: Vec<&'static str>,
    pub l3: Option<String>,
}

impl Cpu {
    /// Reads `/proc/cpuinfo` (and the L3 size from sysfs); fields it cannot find say so.
    pub fn read() -> Cpu {
        let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let field = |name: &str| {
            info.lines()
                .find(|l| l.split(':').next().is_some_and(|k| k.trim() == name))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        };
        let flags: Vec<&str> = info
            .lines()
            .find(|l| l.starts_with("flags") || l.starts_with("Features"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.split_whitespace().collect())
            .unwrap_or_default();
        let known = [
            ("avx512f", "AVX-512F"),
            ("avx512bw", "AVX-512BW"),
            ("avx512_bf16", "AVX-512-BF16"),
            ("avx512_fp16", "AVX-512-FP16"),
            ("avx2", "AVX2"),
            ("fma", "FMA"),
            ("f16c", "F16C"),
            ("sse4_2", "SSE4.2"),
            ("sve", "SVE"),
            ("asimd", "NEON"),
        ];
        let simd = known.iter().filter(|(f, _)| flags.contains(f)).map(|&(_, name)| name).collect();
        let id = match (field("cpu family"), field("model")) {
            (Some(f), Some(m)) => format!("family {f} model {m}"),
            _ => "family/model not listed".to_string(),
        };
        Cpu {
            model: field("model name").unwrap_or_else(|| "unknown CPU".to_string()),
            id,
            listed: info.lines().filter(|l| l.starts_with("processor")).count(),
            usable: cores(),
            simd,
            l3: std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cache/index3/size")
                .ok()
                .map(|s| s.trim().to_string()),
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "{} ({}), {} logical cores listed, {} usable; SIMD: {}; L3 {}",
            self.model,
            self.id,
            self.listed,
            self.usable,
            if self.simd.is_empty() { "none listed".to_string() } else { self.simd.join(" ") },
            self.l3.as_deref().unwrap_or("not listed"),
        )
    }
}

pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |t| t.get())
}

/// The measured limits: f32 FMA throughput and memory bandwidth.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// f32 FLOP/s of one core, and of all usable cores at once.
    pub flops_core: f64,
    pub flops_all: f64,
    /// The core clock, from a chain of dependent integer multiplies (three cycles each): with
    /// the peak it gives the flops a cycle, which says whether the peak is what the core's FMA
    /// units do.
    pub clock_hz: f64,
    /// Bytes per second read from memory by one core, and by all cores at once (buffers far
    /// larger than L3).
    pub read_bw_core: f64,
    pub read_bw: f64,
    /// Bytes per second copied (each byte read once and written once) with all cores at once:
    /// by `memcpy` (`copy_from_slice`), and by the library's streaming copy
    /// (`tile::copy_2d_streaming`, stores that bypass the cache).
    pub copy_bw: f64,
    pub stream_bw: f64,
    /// Which FMA the peak loop used.
    pub isa: &'static str,
}

impl Limits {
    /// Measures each limit as the best of a few short trials (noise on a shared machine only
    /// ever makes a trial slower).
    pub fn measure() -> Limits {
        let n = cores();
        let best = |f: &dyn Fn() -> f64| (0..5).map(|_| f()).fold(0.0, f64::max);
        let (isa, _) = fma_kernel();
        let flops_core = best(&|| flops_on(1));
        let flops_all = best(&|| flops_on(n));
        // Short trials, many: one that another process interrupts only counts as slower.
        let clock_hz = (0..20).map(|_| clock()).fold(0.0, f64::max);
        // 256 MiB read, and 2 x 128 MiB copied: far past any last-level cache here.
        let read = vec![1u64; 32 << 20];
        let read_bw_core = best(&|| read_on(1, &read));
        let read_bw = best(&|| read_on(n, &read));
        drop(read);
        let src = vec![1u8; 128 << 20];
        let mut dst = vec![0u8; 128 << 20];
        let copy_bw = (0..5).map(|_| copy_on(n, &src, &mut dst, false)).fold(0.0, f64::max);
        let stream_bw = (0..5).map(|_| copy_on(n, &src, &mut dst, true)).fold(0.0, f64::max);
        Limits { flops_core, flops_all, clock_hz, read_bw_core, read_bw, copy_bw, stream_bw, isa }
    }

    pub fn describe(&self) -> String {
        format!(
            "measured peak: {:.0} GFLOP/s f32 per core ({} FMA; {:.1} flops a cycle at {:.2} \
             GHz), {:.0} GFLOP/s on all {} cores; memory: {:.1} GB/s read by one core, {:.1} GB/s \
             by all, copied by all: {:.1} GB/s by memcpy, {:.1} GB/s with streaming stores",
            self.flops_core / 1e9,
            self.isa,
            self.flops_core / self.clock_hz,
            self.clock_hz / 1e9,
            self.flops_all / 1e9,
            cores(),
            self.read_bw_core / 1e9,
            self.read_bw / 1e9,
            self.copy_bw / 1e9,
            self.stream_bw / 1e9,
        )
    }

    /// The limit of copying `bytes` (each read once, written once) on all cores: the faster of
    /// memcpy and streaming stores.
    pub fn copy_seconds(&self, bytes: f64) -> f64 {
        bytes / self.copy_bw.max(self.stream_bw)
    }
}

/// Cycles a second, from a chain of dependent 64-bit multiplies: three cycles each on every
/// x86-64 core of the last decade (Intel since Nehalem, AMD since Zen). Not adds: Intel's
/// Golden Cove and later cores fold a chain of `add reg, imm` at rename (an Emerald Rapids here
/// read 11.9 GHz that way).
fn clock() -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        const ROUNDS: u64 = 250_000;
        const LATENCY: u64 = 3;
        let start = Instant::now();
        let mut x: u64 = black_box(1);
        let m: u64 = black_box(3);
        for _ in 0..ROUNDS {
            // SAFETY: register arithmetic only.
            unsafe {
                std::arch::asm!(
                    "imul {0}, {1}", "imul {0}, {1}", "imul {0}, {1}", "imul {0}, {1}",
                    "imul {0}, {1}", "imul {0}, {1}", "imul {0}, {1}", "imul {0}, {1}",
                    inout(reg) x,
                    in(reg) m,
                    options(nomem, nostack),
                )
            };
        }
        black_box(x);
        (8 * LATENCY * ROUNDS) as f64 / start.elapsed().as_secs_f64()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        f64::NAN
    }
}

/// Independent FMA chains: enough to cover the FMA latency on every unit.
const CHAINS: usize = 16;
const FMA_ITERS: usize = 4_000_000;

/// The widest f32 FMA loop this CPU runs, its name, and the flops one call does.
fn fma_kernel() -> (&'static str, fn() -> f64) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked above).
            return ("AVX-512", || unsafe { x86::fma512() });
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            return ("AVX2", || unsafe { x86::fma256() });
        }
    }
    ("scalar", fma_scalar)
}

fn fma_scalar() -> f64 {
    let mut acc = [1.0f32; CHAINS];
    let (x, y) = (black_box(0.999_999f32), black_box(1e-7f32));
    for _ in 0..FMA_ITERS {
        for a in &mut acc {
            *a = a.mul_add(x, y);
        }
    }
    black_box(acc);
    (FMA_ITERS * CHAINS * 2) as f64
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::hint::black_box;

    use super::{CHAINS, FMA_ITERS};

    /// Returns the flops done.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma512() -> f64 {
        let (x, y) = (_mm512_set1_ps(black_box(0.999_999)), _mm512_set1_ps(black_box(1e-7)));
        let mut acc = [_mm512_set1_ps(1.0); CHAINS];
        for _ in 0..FMA_ITERS {
            for a in &mut acc {
                *a = _mm512_fmadd_ps(*a, x, y);
            }
        }
        black_box(acc);
        (FMA_ITERS * CHAINS * 16 * 2) as f64
    }

    /// Sums `data` in four 512-bit lanes of u64 (the loads the kernels do).
    #[target_feature(enable = "avx512f")]
    pub unsafe fn sum512(data: &[u64]) -> [u64; 8] {
        let mut acc = [_mm512_setzero_si512(); 4];
        let blocks = data.chunks_exact(32);
        let rest: u64 = blocks.remainder().iter().fold(0, |a, &x| a.wrapping_add(x));
        for block in blocks {
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: 8 u64 of the 32 in this block.
                let v = unsafe { _mm512_loadu_si512(block.as_ptr().add(8 * j).cast()) };
                *a = _mm512_add_epi64(*a, v);
            }
        }
        let sum =
            _mm512_add_epi64(_mm512_add_epi64(acc[0], acc[1]), _mm512_add_epi64(acc[2], acc[3]));
        let mut out = [0u64; 8];
        // SAFETY: 8 u64 fit `out`.
        unsafe { _mm512_storeu_si512(out.as_mut_ptr().cast(), sum) };
        out[0] = out[0].wrapping_add(rest);
        out
    }

    /// Returns the flops done.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma256() -> f64 {
        let (x, y) = (_mm256_set1_ps(black_box(0.999_999)), _mm256_set1_ps(black_box(1e-7)));
        let mut acc = [_mm256_set1_ps(1.0); CHAINS];
        for _ in 0..FMA_ITERS {
            for a in &mut acc {
                *a = _mm256_fmadd_ps(*a, x, y);
            }
        }
        black_box(acc);
        (FMA_ITERS * CHAINS * 8 * 2) as f64
    }
}

/// Runs `work(i)` on `threads` threads released together; returns the seconds from the first
/// thread's start to the last thread's end (each thread reads the clock itself: the releasing
/// thread may not be scheduled again until a worker is done).
fn timed_on(threads: usize, work: &(dyn Fn(usize) + Sync)) -> f64 {
    let start_line = Barrier::new(threads);
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|i| {
                let start_line = &start_line;
                s.spawn(move || {
                    start_line.wait();
                    let start = Instant::now();
                    work(i);
                    (start, Instant::now())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a measuring thread panicked")).collect()
    });
    let first = spans.iter().map(|s| s.0).min().expect("at least one thread");
    let last = spans.iter().map(|s| s.1).max().expect("at least one thread");
    (last - first).as_secs_f64()
}

/// f32 FLOP/s of `threads` threads running the FMA loop at once.
fn flops_on(threads: usize) -> f64 {
    let (_, kernel) = fma_kernel();
    let flops = kernel(); // warm up, and the flops of one call
    threads as f64 * flops
        / timed_on(threads, &|_| {
            black_box(kernel());
        })
}

/// Bytes per second of `threads` threads each summing its part of `data`.
fn read_on(threads: usize, data: &[u64]) -> f64 {
    let part = data.len().div_ceil(threads);
    let seconds = timed_on(threads, &|i| {
        let chunk = &data[(i * part).min(data.len())..((i + 1) * part).min(data.len())];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked above).
            black_box(unsafe { x86::sum512(chunk) });
            return;
        }
        // Eight lanes of wrapping sums: vectorizes, and no lane waits on another.
        let mut acc = [0u64; 8];
        for block in chunk.chunks_exact(8) {
            for (a, &x) in acc.iter_mut().zip(block) {
                *a = a.wrapping_add(x);
            }
        }
        black_box(acc);
    });
    std::mem::size_of_val(data) as f64 / seconds
}

/// Bytes per second copied by `threads` threads, each copying its part of `src` into `dst`,
/// with memcpy or (`streaming`) the library's streaming copy.
fn copy_on(threads: usize, src: &[u8], dst: &mut [u8], streaming: bool) -> f64 {
    let part = src.len().div_ceil(threads);
    let dst_addr = dst.as_mut_ptr() as usize;
    let len = src.len();
    let seconds = timed_on(threads, &|i| {
        let (start, end) = ((i * part).min(len), ((i + 1) * part).min(len));
        // SAFETY: the threads copy disjoint ranges of `dst`, which outlives them (scoped).
        let d = unsafe {
            std::slice::from_raw_parts_mut((dst_addr as *mut u8).add(start), end - start)
        };
        let s = &src[start..end];
        if streaming {
            let (to, from) = (GlobalPtrMut::from_slice(d), GlobalPtr::from_slice(s));
            // SAFETY: this thread alone touches its range of `dst` and reads `src`.
            unsafe { tile::copy_2d_streaming(to, s.len(), from, s.len(), (1, s.len())) };
        } else {
            d.copy_from_slice(s);
        }
    });
    black_box(dst);
    len as f64 / seconds
}
