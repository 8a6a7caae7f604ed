#!/usr/bin/env python3
"""What a CPU user would otherwise write: the rows of `perf_report`, in mpi4py + numpy.

One process per rank, numpy's BLAS on one thread per rank (as our ranks each compute on their
share of the cores). Each time is the slowest rank's (barrier, op, barrier, max over ranks);
the table gives medians of --reps runs after one warm-up. Not part of CI.

Setup (Debian):  apt-get install openmpi-bin libopenmpi-dev && pip install numpy mpi4py
Run, once per world size:
  OPENBLAS_NUM_THREADS=1 mpirun --allow-run-as-root --oversubscribe -n 2 python3 scripts/mpi_numpy_baseline.py
  OPENBLAS_NUM_THREADS=1 mpirun --allow-run-as-root --oversubscribe -n 4 python3 scripts/mpi_numpy_baseline.py
Rank 0 also times numpy's single-thread sgemm (the one-core rows of perf_report) at world 2.
"""

import argparse
import os
import time

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
me, world = comm.Get_rank(), comm.Get_size()


def timed(op, reps):
    op()  # warm: buffers allocated, pages touched
    times = []
    for _ in range(reps):
        comm.Barrier()
        start = time.perf_counter()
        op()
        comm.Barrier()
        times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return float(np.median(times))


def all_gather_matmul(m, k, n, reps):
    rng = np.random.default_rng(me)
    x = rng.uniform(-1, 1, (m // world, k)).astype(np.float32)
    w = rng.uniform(-1, 1, (k, n // world)).astype(np.float32)
    gathered = np.empty((m, k), np.float32)

    def op():
        comm.Allgather(x, gathered)
        return gathered @ w

    return timed(op, reps)


def matmul_reduce_scatter(m, k, n, reps):
    rng = np.random.default_rng(me)
    h = rng.uniform(-1, 1, (m, k // world)).astype(np.float32)
    w = rng.uniform(-1, 1, (k // world, n)).astype(np.float32)
    out = np.empty((m // world, n), np.float32)

    def op():
        partial = h @ w
        comm.Reduce_scatter_block(partial, out, op=MPI.SUM)
        return out

    return timed(op, reps)


def ulysses(b, s, h, d, reps):
    rng = np.random.default_rng(me)
    x = rng.uniform(-1, 1, (b, s // world, h, d)).astype(np.float32)
    recv = np.empty((world, b, s // world, h // world, d), np.float32)

    def op():
        # [B, s, H, D] -> [world, B, s, h, D]: each peer's heads contiguous.
        send = np.ascontiguousarray(
            x.reshape(b, s // world, world, h // world, d).transpose(2, 0, 1, 3, 4))
        comm.Alltoall(send, recv)
        # [world, B, s, h, D] -> [B, S, h, D]
        return np.ascontiguousarray(recv.transpose(1, 0, 2, 3, 4)).reshape(b, s, h // world, d)

    return timed(op, reps)


def one_core_sgemm(m, k, n, reps):
    rng = np.random.default_rng(0)
    a = rng.uniform(-1, 1, (m, k)).astype(np.float32)
    bm = rng.uniform(-1, 1, (k, n)).astype(np.float32)
    a @ bm
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        a @ bm
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=9)
    reps = parser.parse_args().reps
    square, decode = (2048, 2048, 2048), (16, 4096, 4096)
    rows = [
        ("all_gather_matmul", "M=2048 K=2048 N=2048", all_gather_matmul(*square, reps)),
        ("matmul_reduce_scatter", "M=2048 K=2048 N=2048", matmul_reduce_scatter(*square, reps)),
        ("all_gather_matmul", "M=16 K=4096 N=4096", all_gather_matmul(*decode, reps)),
        ("all_to_all (Ulysses)", "B=1 S=8192 H=32 D=128", ulysses(1, 8192, 32, 128, reps)),
    ]
    core = []
    if world == 2:
        comm.Barrier()
        if me == 0:
            core = [(shape, one_core_sgemm(*shape, reps)) for shape in [(2048, 2048, 2048), (16, 4096, 2048)]]
        comm.Barrier()
    if me == 0:
        library = MPI.Get_library_version().replace(chr(0), "").splitlines()[0]
        print(f"MPI {MPI.Get_version()} ({library}), "
              f"numpy {np.__version__}, OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}; "
              f"medians of {reps} runs, each the slowest rank's")
        print("| op | world | dtype | shape | MPI + numpy ms |")
        print("| --- | --- | --- | --- | --- |")
        for op, shape, t in rows:
            print(f"| {op} | {world} | f32 | {shape} | {t * 1e3:.2f} |")
        for (m, k, n), t in core:
            print(f"| numpy matmul, one core | 1 | f32 | M={m} K={k} N={n} | {t * 1e3:.2f} "
                  f"({2 * m * k * n / t / 1e9:.1f} GFLOP/s) |")


if __name__ == "__main__":
    main()
