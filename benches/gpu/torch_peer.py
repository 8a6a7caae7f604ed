"""PyTorch on the same rows as examples/gpu_report.rs: torch's fused ops (SymmetricMemory async-TP),
its unfused path (NCCL collective, then matmul) and the one-GPU ceiling, bf16, milliseconds,
medians of CUDA-event timings after warm-up, each timed iteration started after a small NCCL
all_reduce (a GPU barrier); the slowest rank's median. Inputs uniform in [-1, 1) as in gpu_report
(never zeros: a product on zeros runs faster).

    torchrun --nproc_per_node=2 benches/gpu/torch_peer.py [--iters 20 --warmup 5]
    python3 benches/gpu/torch_peer.py --local     # the local ops of `gpu_report --local`, one GPU
    python3 benches/gpu/torch_peer.py --train     # the training step of `gpu_report --train`
    python3 benches/gpu/torch_peer.py --gemm      # that step's six products, as `gpu_report --gemm`
    python3 benches/gpu/torch_peer.py --add       # where a same-shape add's time goes, as `gpu_report --add`

NVLink multicast stays off (the machine's rule): NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 are set here if unset.
"""

import argparse
import os
import time

for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(var, value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._symmetric_memory  # noqa: E402,F401  (registers torch.ops.symm_mem)


def median_ms(fn, args, before_each=lambda: None):
    """Median milliseconds of `fn` by CUDA events: `args.warmup` untimed calls, then `args.iters`
    timed ones, each after `before_each` (a GPU barrier across ranks, or nothing)."""
    for _ in range(args.warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(args.iters):
        before_each()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        events.append((start, stop))
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in events)
    return ms[len(ms) // 2]


def run_hot(fn):
    """Runs `fn` for 50 ms (waiting for the GPU every 10 calls), as gpu_report's local rows do
    before timing, so that no row depends on how idle the GPU was before it."""
    start = time.perf_counter()
    while time.perf_counter() - start < 0.05:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()


def uniform(*shape, dtype=torch.bfloat16):
    """Uniform in [-1, 1), drawn in f32 and cast, as gpu_report's inputs."""
    return (torch.rand(*shape, device="cuda", dtype=torch.float32) * 2 - 1).to(dtype)


def add_lines(args):
    """The lines of `gpu_report --add`: torch's same-shape add of two [8192, 8192] bf16 tensors
    timed per call (50 CUDA-event timings after 50 ms and 5 warm-up calls) and in batches of 100
    calls (one event pair around each of 5 batches), with the host's time to queue a call; the
    add into a given output, and of operands made directly in bf16 (not through a cast). Twice."""
    torch.cuda.set_device(0)

    def per_call(fn):
        run_hot(fn)
        return median_ms(fn, argparse.Namespace(warmup=5, iters=50))

    def batched(fn):
        run_hot(fn)
        gpu, host = [], []
        for _ in range(5):
            torch.cuda.synchronize()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            wall = time.perf_counter()
            start.record()
            for _ in range(100):
                fn()
            stop.record()
            host.append((time.perf_counter() - wall) * 1e3 / 100)
            torch.cuda.synchronize()
            gpu.append(start.elapsed_time(stop) / 100)
        return sorted(gpu)[2], sorted(host)[2]

    rand = uniform

    for round_ in (1, 2):
        print(f"# torch_peer --add: torch {torch.__version__}, {torch.cuda.get_device_name()}, round {round_}")
        copied = rand(1 << 28, dtype=torch.float32)
        gbs = 2 * (1 << 30) / (per_call(lambda: copied.clone()) * 1e-3) / 1e9
        roof = 3 * 8192 * 8192 * 2 / (gbs * 1e9) * 1e3
        print(f"copy {gbs:.0f} GB/s; add roofline {roof:.4f} ms")
        x, y = rand(8192, 8192), rand(8192, 8192)
        pc = per_call(lambda: x + y)
        b, h = batched(lambda: x + y)
        print(f"add: per call {pc:.4f} ms ({pc / roof:.4f} of roofline), batched {b:.4f} ({b / roof:.4f}), host {h:.4f} ms to queue a call")
        pc = per_call(lambda: x * y)
        print(f"mul: per call {pc:.4f} ms ({pc / roof:.4f})")
        out = torch.empty_like(x)
        pc = per_call(lambda: torch.add(x, y, out=out))
        print(f"add into a given output: per call {pc:.4f} ms ({pc / roof:.4f})")
        u = torch.empty(8192, 8192, device="cuda", dtype=torch.bfloat16).uniform_(-1, 1)
        v = torch.empty(8192, 8192, device="cuda", dtype=torch.bfloat16).uniform_(-1, 1)
        pc = per_call(lambda: u + v)
        print(f"add, operands made in bf16: per call {pc:.4f} ms ({pc / roof:.4f})")
        del copied, x, y, out, u, v
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--local", action="store_true", help="the local-op rows, one GPU, no torchrun")
    parser.add_argument("--train", action="store_true", help="the MLP training step, one GPU, no torchrun")
    parser.add_argument("--gemm", action="store_true", help="the training step's products, one GPU, no torchrun")
    parser.add_argument("--add", action="store_true", help="where a same-shape add's time goes, one GPU, no torchrun")
    args = parser.parse_args()
    if args.local:
        local_rows(args)
        return
    if args.train:
        train_step(args)
        return
    if args.gemm:
        step_products(args)
        return
    if args.add:
        add_lines(args)
        return

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    group_name = group.group_name
    dtype = torch.bfloat16
    bar = torch.zeros(1, device="cuda")

    def timeit(fn):
        t = torch.tensor([median_ms(fn, args, before_each=lambda: dist.all_reduce(bar))], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def guarded(fn):
        try:
            return f"{timeit(fn):.3f}"
        except Exception as e:
            if rank == 0:
                print(f"# failed: {type(e).__name__}: {str(e)[:200]}")
            return "failed"

    def randn(*shape):
        # Uniform in [-1, 1), as gpu_report draws (a product's speed depends a little on its data).
        return (torch.rand(*shape, device="cuda", dtype=torch.float32) * 2 - 1).to(dtype)

    rows = []
    for m, k, n in [(8192, 8192, 14336), (4096, 12288, 24576), (16384, 8192, 4096), (256, 8192, 14336)]:
        a_shard, b, a_full = randn(m // world, k), randn(k, n), randn(m, k)
        gathered = torch.empty(m, k, device="cuda", dtype=dtype)

        def unfused():
            dist.all_gather_into_tensor(gathered, a_shard)
            return gathered @ b

        def fused():
            return torch.ops.symm_mem.fused_all_gather_matmul(a_shard, [b], 0, group_name)

        rows.append(("all_gather_matmul", f"M={m} K={k} N_local={n}", guarded(unfused), guarded(fused), guarded(lambda: a_full @ b)))
        del a_shard, b, a_full, gathered
    for m, k, n in [(8192, 14336, 8192), (4096, 24576, 12288), (16384, 4096, 8192), (256, 14336, 8192)]:
        a, b = randn(m, k), randn(k, n)
        out = torch.empty(m // world, n, device="cuda", dtype=dtype)

        def unfused():
            dist.reduce_scatter_tensor(out, a @ b)
            return out

        def fused():
            return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group_name)

        rows.append(("matmul_reduce_scatter", f"M={m} K_local={k} N={n}", guarded(unfused), guarded(fused), guarded(lambda: a @ b)))
        del a, b, out
    for bsz, s, h, d in [(1, 32768, 32, 128), (4, 8192, 64, 128)]:
        x = randn(bsz, s // world, h, d)
        recv = torch.empty(world, bsz, s // world, h // world, d, device="cuda", dtype=dtype)

        def unfused():
            send = x.reshape(bsz, s // world, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()
            dist.all_to_all_single(recv, send)
            return recv.permute(1, 0, 2, 3, 4).reshape(bsz, s, h // world, d).contiguous()

        rows.append(("Ulysses all_to_all", f"B={bsz} S={s} H={h} D={d}", guarded(unfused), "-", guarded(lambda: x.clone())))
        del x, recv

    if rank == 0:
        name = torch.cuda.get_device_name()
        print(f"# torch_peer: torch {torch.__version__}, {world} x {name}, bf16, ms (median of {args.iters} after {args.warmup} warm-up)")
        print()
        print("| op | shape | torch unfused (NCCL) | torch fused | torch ceiling |")
        print("| --- | --- | --- | --- | --- |")
        for r in rows:
            print("| " + " | ".join(r) + " |")
    dist.destroy_process_group()


def local_rows(args):
    """The rows of `gpu_report --local`: the same ops and shapes, eager PyTorch, bf16 unless
    named, against the same roofline (a device copy of 1 GiB, bytes read + written)."""
    torch.cuda.set_device(0)
    bf = torch.bfloat16

    def timeit(fn):
        run_hot(fn)
        return median_ms(fn, args)

    rand = uniform
    copied = rand(1 << 28, dtype=torch.float32)
    copy_gbs = 2 * (1 << 30) / (timeit(lambda: copied.clone()) * 1e-3) / 1e9
    square, other, wide = rand(8192, 8192), rand(8192, 8192), rand(16384, 8192)
    weight, bias, single = rand(8192), rand(8192), rand(8192, 8192, dtype=torch.float32)
    a, b = rand(32, 2048, 128), rand(32, 128, 2048)
    n, wide_n, e = 8192 * 8192, 16384 * 8192, 2
    gelu = torch.nn.functional.gelu
    rows = [
        ("add", "[8192, 8192]", lambda: square + other, 3 * n * e),
        ("mul", "[8192, 8192]", lambda: square * other, 3 * n * e),
        ("gelu", "[8192, 8192]", lambda: gelu(square), 2 * n * e),
        ("gelu_tanh", "[8192, 8192]", lambda: gelu(square, approximate="tanh"), 2 * n * e),
        ("silu", "[8192, 8192]", lambda: torch.nn.functional.silu(square), 2 * n * e),
        ("cast f32 -> bf16", "[8192, 8192]", lambda: single.to(bf), 6 * n),
        ("softmax (last dim)", "[16384, 8192]", lambda: torch.softmax(wide, dim=-1), 2 * wide_n * e),
        ("rms_norm (last dim)", "[16384, 8192]", lambda: torch.nn.functional.rms_norm(wide, (8192,), weight, 1e-5), 2 * wide_n * e),
        ("layer_norm (last dim)", "[16384, 8192]", lambda: torch.nn.functional.layer_norm(wide, (8192,), weight, bias, 1e-5), 2 * wide_n * e),
        ("transpose (last two)", "[8192, 8192]", lambda: square.t().contiguous(), 2 * n * e),
    ]
    print(f"# torch_peer --local: torch {torch.__version__}, {torch.cuda.get_device_name()}, ms (median of {args.iters} after 50 ms and {args.warmup} warm-up); roofline: a device copy at {copy_gbs:.0f} GB/s (read + write)")
    print()
    print("| op | shape | torch ms | roofline ms | of roofline | TFLOP/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for op, shape, fn, nbytes in rows:
        ms = timeit(fn)
        roof = nbytes / (copy_gbs * 1e9) * 1e3
        print(f"| {op} | {shape} | {ms:.4f} | {roof:.4f} | {ms / roof:.3f} | |")
    ms = timeit(lambda: torch.bmm(a, b))
    print(f"| bmm | [32, 2048, 128] x [32, 128, 2048] | {ms:.4f} | | | {2 * 32 * 2048 * 2048 * 128 / (ms * 1e-3) / 1e12:.0f} |")


def train_step(args):
    """The step of `gpu_report --train` in eager PyTorch: y = gelu(x @ W1 + b1) @ W2 + b2, MSE,
    autograd's backward (x's gradient included), Adam (bf16 parameters; fused and not), median of CUDA-event timings."""
    torch.cuda.set_device(0)
    bf = torch.bfloat16
    m, e, f = 8192, 4096, 16384

    def rand(*shape, scale=1.0):
        return ((torch.rand(*shape, device="cuda") * 2 - 1) * scale).to(bf)

    # x's gradient too: our MLP's backward returns it (a layer inside a model needs it), so the
    # step does six products in both.
    x, target = rand(m, e).requires_grad_(), rand(m, e)
    for fused in (True, False):
        params = [
            rand(e, f, scale=e**-0.5).requires_grad_(),
            rand(f, scale=0.1).requires_grad_(),
            rand(f, e, scale=f**-0.5).requires_grad_(),
            rand(e, scale=0.1).requires_grad_(),
        ]
        w1, b1, w2, b2 = params
        opt = torch.optim.Adam(params, lr=1e-4, fused=fused)

        def step():
            y = torch.nn.functional.gelu(x @ w1 + b1) @ w2 + b2
            loss = torch.nn.functional.mse_loss(y, target)
            opt.zero_grad(set_to_none=True)
            x.grad = None
            loss.backward()
            opt.step()
            return loss

        ms = median_ms(step, args)
        flops = 6 * 2 * m * e * f
        print(f"# torch_peer --train: torch {torch.__version__}, {torch.cuda.get_device_name()}, M={m} E={e} F={f} bf16, Adam fused={fused}: {ms:.2f} ms a step (median of {args.iters} after {args.warmup} warm-up), {flops / (ms * 1e-3) / 1e12:.0f} TFLOP/s of its products")
        if fused:
            # Each part alone, as gpu_report --train times ours.
            def forward():
                return torch.nn.functional.gelu(x @ w1 + b1) @ w2 + b2

            def forward_backward():
                y = forward()
                loss = torch.nn.functional.mse_loss(y, target)
                opt.zero_grad(set_to_none=True)
                x.grad = None
                loss.backward()

            fwd = median_ms(forward, args)
            bwd = median_ms(forward_backward, args) - fwd
            adam = median_ms(opt.step, args)
            print(f"#   alone: forward {fwd:.2f} ms, backward {bwd:.2f} ms (forward + backward less forward), Adam {adam:.2f} ms")
            with torch.no_grad():
                p1 = x @ w1
                a1 = p1 + b1
                g1 = torch.nn.functional.gelu(a1)
                p2 = g1 @ w2
                pieces = [
                    median_ms(lambda: x @ w1, args),
                    median_ms(lambda: p1 + b1, args),
                    median_ms(lambda: torch.nn.functional.gelu(a1), args),
                    median_ms(lambda: g1 @ w2, args),
                    median_ms(lambda: p2 + b2, args),
                    median_ms(lambda: torch.ops.aten.gelu_backward(g1, a1), args),
                    median_ms(lambda: p1.sum(0), args),
                ]
            q1, bias1, gelu, q2, bias2, gelu_grad, bias_grad = pieces
            print(f"#   forward's pieces alone: x @ W1 {q1:.3f} ms, + b1 {bias1:.3f}, gelu {gelu:.3f}, h @ W2 {q2:.3f}, + b2 {bias2:.3f} (sum {q1 + bias1 + gelu + q2 + bias2:.2f} ms, forward {fwd:.2f}); gelu_backward {gelu_grad:.3f} ms, bias gradient (sum over rows of [M, F]) {bias_grad:.3f} ms")


def step_products(args):
    """The six products of the training step (as `gpu_report --gemm`), each timed as that times a
    candidate (30 warm-up runs, the fastest of 3 passes of 20), with the kernel cuBLAS ran."""
    torch.cuda.set_device(0)
    bf = torch.bfloat16
    m, e, f = 8192, 4096, 16384

    def rand(*shape):
        return (torch.rand(*shape, device="cuda") * 2 - 1).to(bf)

    x, w1, h, w2, dy, dh = rand(m, e), rand(e, f), rand(m, f), rand(f, e), rand(m, e), rand(m, f)
    products = [
        ("x @ W1", (m, f, e), lambda: x @ w1),
        ("h @ W2", (m, e, f), lambda: h @ w2),
        ("h^T @ dy (dW2)", (f, e, m), lambda: h.t() @ dy),
        ("dy @ W2^T (dh)", (m, f, e), lambda: dy @ w2.t()),
        ("x^T @ dh (dW1)", (e, f, m), lambda: x.t() @ dh),
        ("dh @ W1^T (dx)", (m, e, f), lambda: dh @ w1.t()),
    ]
    print(f"# torch_peer --gemm: torch {torch.__version__}, {torch.cuda.get_device_name()}, bf16, the fastest of 3 passes of 20 after 30 warm-up runs")
    for name, (pm, pn, pk), fn in products:
        for _ in range(30):
            fn()
        best = float("inf")
        for _ in range(3):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                fn()
            stop.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(stop) / 20)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = sorted({evt.name for evt in prof.events() if evt.device_type == torch.autograd.DeviceType.CUDA})
        flops = 2 * pm * pn * pk
        print(f"{name}: m={pm} n={pn} k={pk}: {best:.4f} ms {flops / (best * 1e-3) / 1e12:.0f} TFLOP/s; kernels: {'; '.join(kernels)}")


if __name__ == "__main__":
    main()
