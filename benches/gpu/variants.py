"""Kernel variants against the library's own elementwise kernels, on one GPU, in one process.

Compiles src/device/cuda/kernels/common.cuh + local.cu (as the library does, for bf16) together
with benches/gpu/variants.cu through CuPy's NVRTC, and times each kernel on [8192, 8192] bf16
(uniform in [-4, 4), never zeros) beside PyTorch's op and a device copy (the roofline: bytes read
+ written over the copy's bandwidth), medians of CUDA-event timings after 50 ms of warm-up. Each
output is checked bit for bit against the exactly rounded f64 result (torch on float64 inputs):
'mismatch' counts elements that differ, 'max ulp' the largest difference in bf16 units.

    python3 benches/gpu/variants.py [--iters 30]
    python3 benches/gpu/variants.py --add [--rounds 5]   # same-shape add only: cache hints and the bulk copy engine, torch's in turn
    python3 benches/gpu/variants.py --unary [--rounds 5] # silu and gelu_tanh: the library's chunks, torch's launch shape, torch's in turn

Not part of CI (needs a GPU, CuPy and PyTorch).
"""

import argparse
import pathlib
import time

import cupy as cp
import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNELS = ROOT / "src/device/cuda/kernels"


def module():
    code = "\n".join(
        [
            "#define DT_ELEM 3",
            (KERNELS / "common.cuh").read_text(),
            (KERNELS / "local.cu").read_text(),
            (ROOT / "benches/gpu/variants.cu").read_text(),
        ]
    )
    return cp.RawModule(code=code, options=("-std=c++17", "-default-device", "-lineinfo"), backend="nvrtc")


def library_module(code, extra=(), ptx=False, lineinfo=True):
    """`code` compiled as the library compiles its kernels (kernels.rs: NVRTC, the same options,
    a cubin for this GPU), through the NVRTC that ctypes finds first, loaded by CuPy; with `extra`
    options, without -lineinfo, or to PTX that the driver compiles when CuPy loads it."""
    import ctypes
    import ctypes.util
    import tempfile

    name = None
    for cand in ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so", ctypes.util.find_library("nvrtc")):
        try:
            lib = ctypes.CDLL(cand)
            name = cand
            break
        except (OSError, TypeError):
            continue
    if name is None:
        return None, "no libnvrtc"
    major, minor = torch.cuda.get_device_capability(0)
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), b"local.cu", 0, None, None) == 0
    arch = f"compute_{major}{minor}" if ptx else f"sm_{major}{minor}"
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", b"-default-device"]
    opts += [b"-lineinfo"] if lineinfo else []
    opts += [o.encode() for o in extra]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    if rc != 0:
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        return None, log.value.decode()[-2000:]
    size = ctypes.c_size_t()
    (lib.nvrtcGetPTXSize if ptx else lib.nvrtcGetCUBINSize)(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    (lib.nvrtcGetPTX if ptx else lib.nvrtcGetCUBIN)(prog, cubin)
    major_v, minor_v = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major_v), ctypes.byref(minor_v))
    path = tempfile.mktemp(suffix=".ptx" if ptx else ".cubin")
    with open(path, "wb") as f:
        f.write(cubin.raw.rstrip(b"\0") if ptx else cubin.raw)
    return cp.RawModule(path=path), f"{name} {major_v.value}.{minor_v.value}, cubin at {path}"


def median_ms(fn, iters):
    start = time.perf_counter()
    while time.perf_counter() - start < 0.05:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        events.append((a, b))
    torch.cuda.synchronize()
    ms = sorted(a.elapsed_time(b) for a, b in events)
    return ms[len(ms) // 2]


def ulps(out, ref):
    """Elements that differ, and the largest difference in bf16 units (ordered bit patterns)."""
    o = out.view(torch.int16).to(torch.int32)
    r = ref.view(torch.int16).to(torch.int32)
    # Map sign-magnitude to an ordered integer line.
    o = torch.where(o < 0, -32768 - o, o)
    r = torch.where(r < 0, -32768 - r, r)
    d = (o - r).abs()
    return int((d != 0).sum()), int(d.max())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--add", action="store_true", help="the same-shape add's variants only (cache hints, bulk copies)")
    parser.add_argument("--unary", action="store_true", help="silu and gelu_tanh in turns: the library's chunks, other walks, torch's")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.cuda.set_device(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    mod = module()
    if args.add:
        return add_variants(mod, sms, args)
    if args.unary:
        return unary_variants(mod, args)
    code = "\n".join(["#define DT_ELEM 3", (KERNELS / "common.cuh").read_text(), (KERNELS / "local.cu").read_text(), (ROOT / "benches/gpu/variants.cu").read_text()])
    builds = {
        "cubin": library_module(code),
        "cubin, no -lineinfo": library_module(code, lineinfo=False),
        "ptx, driver-compiled": library_module(code, ptx=True),
        "cubin -Xptxas=-O3": library_module(code, extra=("-Xptxas=-O3",)),
        "cubin --extra-device-vectorization": library_module(code, extra=("--extra-device-vectorization",)),
    }
    for label, (_, info) in builds.items():
        print(f"# the library's compilation, {label}: {info}")
    n = 8192 * 8192
    x = ((torch.rand(8192, 8192, device="cuda") * 2 - 1) * 4).to(torch.bfloat16)
    y = ((torch.rand(8192, 8192, device="cuda") * 2 - 1) * 4).to(torch.bfloat16)
    out = torch.empty_like(x)
    big = torch.rand(1 << 28, device="cuda")
    big_out = torch.empty_like(big)
    copy_ms = median_ms(lambda: big_out.copy_(big), args.iters)
    gbs = 2 * big.numel() * 4 / (copy_ms * 1e-3) / 1e9
    roof_unary = 2 * n * 2 / (gbs * 1e9) * 1e3
    roof_binary = 3 * n * 2 / (gbs * 1e9) * 1e3
    print(f"# {torch.cuda.get_device_name()} ({sms} SMs), torch {torch.__version__}, cupy {cp.__version__}; copy {gbs:.0f} GB/s; medians of {args.iters}")
    gelu_ref = torch.nn.functional.gelu(x.double()).to(torch.bfloat16)
    silu_ref = torch.nn.functional.silu(x.double()).to(torch.bfloat16)
    add_ref = (x.double() + y.double()).to(torch.bfloat16)
    nv = n // 8
    chunks = lambda u: (nv + u * 256 - 1) // (u * 256)  # noqa: E731
    p = lambda t: np.uint64(t.data_ptr())  # noqa: E731
    rows = []

    def unary(name, grid, ref, lib=False, block=256, inp=None):
        inp = x if inp is None else inp
        f = mod.get_function(name.split(" ")[0])
        extra = (np.float64(0.0),) if lib else ()
        launch = lambda: f((grid,), (block,), (p(out), p(inp), np.uint64(n)) + extra)  # noqa: E731
        out.fill_(float("nan"))
        launch()
        torch.cuda.synchronize()
        mism, ulp = ulps(out, ref)
        rows.append((f"{name} grid {grid} block {block}", median_ms(launch, args.iters), roof_unary, mism, ulp))

    def binary(name, grid, block=256):
        f = mod.get_function(name)
        launch = lambda: f((grid,), (block,), (p(out), p(x), p(y), np.uint64(n)))  # noqa: E731
        out.fill_(float("nan"))
        launch()
        torch.cuda.synchronize()
        mism, ulp = ulps(out, add_ref)
        rows.append((f"{name} grid {grid} block {block}", median_ms(launch, args.iters), roof_binary, mism, ulp))

    def blocks(u, block):
        return (nv + u * block - 1) // (u * block)

    def torch_row(name, fn, roof, ref):
        r = fn()
        mism, ulp = ulps(r, ref) if ref is not None else (0, 0)
        rows.append((f"torch {name}", median_ms(fn, args.iters), roof, mism, ulp))

    torch_row("gelu", lambda: torch.nn.functional.gelu(x), roof_unary, gelu_ref)
    unary("dt_gelu", chunks(4), gelu_ref, lib=True)
    narrow = (torch.rand(8192, 8192, device="cuda") * 2 - 1).to(torch.bfloat16)
    unary("dt_gelu on [-1, 1)", chunks(4), torch.nn.functional.gelu(narrow.double()).to(torch.bfloat16), lib=True, inp=narrow)
    def built(label, m, name, ref, lib):
        f = m.get_function(name)
        extra = (np.float64(0.0),) if lib else ()
        launch = lambda: f((chunks(4),), (256,), (p(out), p(x), np.uint64(n)) + extra)  # noqa: E731
        out.fill_(float("nan"))
        launch()
        torch.cuda.synchronize()
        mism, ulp = ulps(out, ref)
        rows.append((f"{name}, {label}", median_ms(launch, args.iters), roof_unary, mism, ulp))

    for label, (m, _) in builds.items():
        if m is None:
            continue
        built(label, m, "dt_gelu", gelu_ref, True)
        built(label, m, "dt_silu", silu_ref, True)
        built(label, m, "var_gelu_fast9", gelu_ref, False)
        built(label, m, "var_gelu_fast5", gelu_ref, False)
    unary("var_gelu_fast9", chunks(4), gelu_ref)
    unary("var_gelu_fast5", chunks(4), gelu_ref)
    unary("var_gelu_u8", chunks(8), gelu_ref)
    unary("var_gelu_u2", chunks(2), gelu_ref)
    for waves in (4, 8, 16):
        unary("var_gelu_pipe", sms * waves, gelu_ref)
    unary("var_gelu_short", chunks(4), gelu_ref)
    for waves in (8, 16):
        unary("var_gelu_short_pipe", sms * waves, gelu_ref)
    torch_row("silu", lambda: torch.nn.functional.silu(x), roof_unary, silu_ref)
    unary("dt_silu", chunks(4), silu_ref, lib=True)
    unary("var_silu_pipe", sms * 8, silu_ref)
    torch_row("clone", lambda: x.clone(), roof_unary, x)
    unary("var_copy_u4", chunks(4), x)
    unary("var_copy_pipe", sms * 8, x)
    torch_row("add", lambda: x + y, roof_binary, add_ref)
    binary("var_add_u4", chunks(4))
    binary("var_add_u2", chunks(2))
    binary("var_add_u8", chunks(8))
    binary("var_add_cs", chunks(4))
    for waves in (4, 8):
        binary("var_add_pipe", sms * waves)
    for u in (1, 2, 4):
        for block in (128, 256, 512, 1024):
            binary(f"var_add32_u{u}", blocks(u, block), block)
    for u in (1, 2, 4):
        for block in (128, 256, 1024):
            unary(f"var_copy32_u{u}", blocks(u, block), x, block=block)
    # The library's add in its own walk (DT_ZIP_CHUNKS, four pairs a thread): var_add_u4 is that.
    print()
    print("| kernel | ms | of roofline | mismatching elements | max ulp |")
    print("| --- | --- | --- | --- | --- |")
    for name, ms, roof, mism, ulp in rows:
        print(f"| {name} | {ms:.4f} | {ms / roof:.3f} | {mism} | {ulp} |")


def add_variants(mod, sms, args):
    """The same-shape add with cache hints on its loads and stores (variants.cu's
    VAR_ADD_HINT) and through the bulk copy engine (var_add_tma, on `sms` multiprocessors),
    every variant and torch's add taking turns for `--rounds` rounds: per round the median of
    `--iters` per-call timings; printed, the median and range over the rounds."""
    n = 8192 * 8192
    x = ((torch.rand(8192, 8192, device="cuda") * 2 - 1) * 4).to(torch.bfloat16)
    y = ((torch.rand(8192, 8192, device="cuda") * 2 - 1) * 4).to(torch.bfloat16)
    out = torch.empty_like(x)
    ref = (x.double() + y.double()).to(torch.bfloat16)
    big = torch.rand(1 << 28, device="cuda")
    big_out = torch.empty_like(big)
    nv = n // 8
    p = lambda t: np.uint64(t.data_ptr())  # noqa: E731
    names = ["plain", "l2_256", "nc_l2_256", "evict", "lu", "st_cs", "st_evict", "l2_256_st_cs", "evict_both", "l2_256_u1", "l2_256_u4"]
    launches = {"torch add": lambda: torch.add(x, y, out=out)}
    for name in names:
        f = mod.get_function(f"var_add_h_{name}")
        u = 1 if name.endswith("_u1") else 4 if name.endswith("_u4") else 2
        for block in (128, 256):
            grid = (nv + u * block - 1) // (u * block)
            launches[f"{name} block {block}"] = (lambda f=f, grid=grid, block=block: f((grid,), (block,), (p(out), p(x), p(y), np.uint64(n))))
    for name, u in (("u1_m16", 1), ("u2_m16", 2), ("u2_m12", 2)):
        f = mod.get_function(f"var_add_occ_{name}")
        grid = (nv + u * 128 - 1) // (u * 128)
        launches[f"occupancy {name} block 128"] = (lambda f=f, grid=grid: f((grid,), (128,), (p(out), p(x), p(y), np.uint64(n))))
    tma = mod.get_function("var_add_tma")
    for per_sm in (2, 4, 5):
        for block in (128, 256):
            grid = sms * per_sm
            launches[f"tma, {per_sm} blocks an SM, block {block}"] = (lambda grid=grid, block=block: tma((grid,), (block,), (p(out), p(x), p(y), np.uint64(n))))
    bad = {}
    for label, launch in launches.items():
        out.fill_(float("nan"))
        launch()
        torch.cuda.synchronize()
        bad[label] = ulps(out, ref)
    in_turns(launches, bad, big, big_out, 3 * n * 2, args, "add of [8192, 8192] bf16")


def in_turns(launches, bad, big, big_out, bytes_moved, args, title):
    """Every launch taking turns for `--rounds` rounds (per round the median of `--iters`
    calls), with a device copy for the roofline; prints the median and range over the rounds."""
    times = {label: [] for label in launches}
    copies = []
    for _ in range(args.rounds):
        copy_ms = median_ms(lambda: big_out.copy_(big), args.iters)
        copies.append(2 * big.numel() * 4 / (copy_ms * 1e-3) / 1e9)
        for label, launch in launches.items():
            times[label].append(median_ms(launch, args.iters))
    gbs = float(np.median(copies))
    roof = bytes_moved / (gbs * 1e9) * 1e3
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}: {title}, {args.rounds} rounds in turn, each the median of {args.iters} calls; copy {gbs:.0f} GB/s (roofline {roof:.4f} ms)")
    print("| kernel | median ms | range | of roofline | / torch | mismatching | max ulp |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    t0 = float(np.median(next(ms for label, ms in times.items() if label.startswith("torch"))))
    for label, ms in times.items():
        m = float(np.median(ms))
        print(f"| {label} | {m:.4f} | {min(ms):.4f}-{max(ms):.4f} | {m / roof:.4f} | {m / t0:.4f} | {bad[label][0]} | {bad[label][1]} |")


def unary_variants(mod, args):
    """silu and gelu_tanh of [8192, 8192] bf16: torch's, the library's chunked walk (dt_*, four
    vectors a thread in blocks of 256) and the 32-bit walk of one, two or four vectors a thread
    in blocks of 128 or 256 (U = 1, block 128 is torch's launch shape), and U = 1 bounded to 16
    blocks of 128 an SM, in turns; each output (torch's too) checked against the exactly rounded
    f64 result."""
    n = 8192 * 8192
    x = ((torch.rand(8192, 8192, device="cuda") * 2 - 1) * 4).to(torch.bfloat16)
    out = torch.empty_like(x)
    big = torch.rand(1 << 28, device="cuda")
    big_out = torch.empty_like(big)
    nv = n // 8
    p = lambda t: np.uint64(t.data_ptr())  # noqa: E731
    for op, fn in (("silu", lambda t: torch.nn.functional.silu(t)), ("gelu_tanh", lambda t: torch.nn.functional.gelu(t, approximate="tanh"))):
        ref = fn(x.double()).to(torch.bfloat16)
        lib = mod.get_function(f"dt_{op}")
        launches = {f"torch {op}": lambda fn=fn: fn(x)}
        grid = (nv + 4 * 256 - 1) // (4 * 256)
        launches[f"dt_{op} (library) block 256"] = lambda grid=grid: lib((grid,), (256,), (p(out), p(x), np.uint64(n), np.float64(0.0)))
        for u in (1, 2, 4):
            f = mod.get_function(f"var_{op}32_u{u}")
            for block in (128, 256):
                g = (nv + u * block - 1) // (u * block)
                launches[f"var_{op}32_u{u} block {block}"] = lambda f=f, g=g, block=block: f((g,), (block,), (p(out), p(x), np.uint64(n)))
        f = mod.get_function(f"var_{op}_occ")
        launches[f"var_{op}_occ block 128"] = lambda f=f: f(((nv + 127) // 128,), (128,), (p(out), p(x), np.uint64(n)))
        bad = {}
        for label, launch in launches.items():
            out.fill_(float("nan"))
            r = launch()
            torch.cuda.synchronize()
            bad[label] = ulps(r if label.startswith("torch") else out, ref)
        in_turns(launches, bad, big, big_out, 2 * n * 2, args, f"{op} of [8192, 8192] bf16")


if __name__ == "__main__":
    main()
