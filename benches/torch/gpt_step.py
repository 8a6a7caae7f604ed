"""One training step of examples/09_train_gpt.rs's GPT in PyTorch eager, on the CPU, timed.

The same model as 09 (GptConfig: vocab 11, embed 32, 4 heads, MLP 64, 2 layers, 12 positions;
pre-norm blocks with RMS norm, causal attention without biases, an exact-GELU MLP, a final RMS
norm and a head without bias) and the same step: forward, cross-entropy on the 6 reversed
digits of each of 8 sequences, zero_grad, backward, gradient clipping to norm 1, AdamW.

    python3 benches/torch/gpt_step.py --world 1 --steps 30   # one process, one thread
    python3 benches/torch/gpt_step.py --world 2 --steps 30   # two processes, tensor-parallel

World 2 is PyTorch's tensor parallelism on gloo: torch.distributed.tensor.parallel's
ColwiseParallel on q, k, v and fc1, RowwiseParallel on the attention output and fc2 (heads
and the MLP split over the ranks, Megatron-style), one thread per process. Each prints the
median and fastest step over --steps steps after 3 unmeasured ones. Compare with
`cargo run --release --example 09_train_gpt -- --processes N --bench 30` (docs/results/2026-12-01-gpt-step-vs-torch-zen4.md). Not part of CI: it needs torch (`pip install torch`).
"""

import argparse
import os
import random
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

DIGITS, SEP, BATCH = 6, 10, 8
VOCAB, EMBED, HEADS, HIDDEN, LAYERS, SEQ = 11, 32, 4, 64, 2, 2 * DIGITS


def batch(step):
    rng = random.Random(1000 + step)
    ids, targets = [], []
    for _ in range(BATCH):
        digits = [rng.randrange(10) for _ in range(DIGITS)]
        seq = digits + [SEP] + digits[::-1]
        ids.append(seq[: 2 * DIGITS])
        targets.append([seq[i] if i > DIGITS else -100 for i in range(1, 2 * DIGITS + 1)])
    return torch.tensor(ids), torch.tensor(targets)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(EMBED, EMBED, bias=False)
        self.k = nn.Linear(EMBED, EMBED, bias=False)
        self.v = nn.Linear(EMBED, EMBED, bias=False)
        self.out = nn.Linear(EMBED, EMBED, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        d = EMBED // HEADS
        # -1 heads: this rank's heads when q, k, v are column-parallel.
        q, k, v = (t(x).view(b, s, -1, d).transpose(1, 2) for t in (self.q, self.k, self.v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, s, -1))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(EMBED, HIDDEN, bias=False)
        self.fc2 = nn.Linear(HIDDEN, EMBED, bias=False)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.attn = nn.RMSNorm(EMBED, eps=1e-5), Attention()
        self.norm2, self.mlp = nn.RMSNorm(EMBED, eps=1e-5), Mlp()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Gpt(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBED)
        self.pos = nn.Parameter(torch.randn(SEQ, EMBED) * 0.5)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(EMBED, eps=1e-5)
        self.head = nn.Linear(EMBED, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids) + self.pos
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


def clip_grad_norm(params, max_norm):
    """clip_grad_norm_ over a tensor-parallel model: the squares of the sharded gradients
    (DTensors) summed over the ranks, the replicated ones counted once (as 09's clip_grad_norm);
    torch's own refuses a mix of DTensors and tensors."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    sharded = sum(g.to_local().pow(2).sum() for g in grads if isinstance(g, DTensor))
    replicated = sum(g.pow(2).sum() for g in grads if not isinstance(g, DTensor))
    sharded = torch.as_tensor(sharded, dtype=torch.float32)
    torch.distributed.all_reduce(sharded)
    norm = (sharded + replicated).sqrt()
    if norm > max_norm:
        for g in grads:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(max_norm / (norm + 1e-6))
    return norm


def time_steps(model, steps, world=1):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    times = []
    for step in range(steps + 3):
        ids, targets = batch(step)
        start = time.perf_counter()
        logits = model(ids)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        if world == 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            clip_grad_norm(list(model.parameters()), 1.0)
        opt.step()
        if step >= 3:
            times.append(time.perf_counter() - start)
    return times


def report(world, times):
    print(
        f"torch {torch.__version__} gpt step (09's model, f32, {world} process(es), 1 thread "
        f"each, batch {BATCH} x {SEQ} tokens): median {statistics.median(times) * 1e3:.3f} ms, "
        f"fastest {min(times) * 1e3:.3f} ms over {len(times)} steps",
        flush=True,
    )


def tensor_parallel(rank, world, steps):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(7)
    model = Gpt()
    plan = {}
    for i in range(LAYERS):
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc1"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.out", "mlp.fc2"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    times = time_steps(model, steps, world)
    if rank == 0:
        report(world, times)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    if args.world == 1:
        torch.set_num_threads(1)
        torch.manual_seed(7)
        report(1, time_steps(Gpt(), args.steps))
    else:
        import torch.multiprocessing as mp

        mp.spawn(tensor_parallel, args=(args.world, args.steps), nprocs=args.world)


if __name__ == "__main__":
    main()
