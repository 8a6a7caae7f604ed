#!/usr/bin/env python3
"""perf_report and the mpi4py + numpy baseline, interleaved: round after round, each round one
`perf_report --runs 1` then `mpi_numpy_baseline.py` at world 2 and at world 4, so that a change
in the machine's load between rounds reaches both sides alike. Prints the table of the host runs
in docs/results/ (see docs/PERFORMANCE.md): every ratio is the median over the rounds of that
round's ratio (fused/numpy pairs the fused time with the same round's numpy time), with the range
over the rounds; times are medians over the rounds.

Run from the repository root after `cargo build --release --example perf_report` (the MPI side
needs `apt-get install openmpi-bin libopenmpi-dev` and `pip install numpy mpi4py`):
  python3 scripts/perf_rounds.py --rounds 5 --reps 9 [--out DIR] [--only TEXT]
Each round's raw output is kept in DIR (default: a fresh temporary directory), with the load
average before and after it. Not part of CI.
"""

import argparse
import os
import re
import statistics
import subprocess
import tempfile

REPORT = "target/release/examples/perf_report"


def load():
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def run(cmd, env=None):
    return subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout


def rows(text, key_cols, value_cols):
    """The markdown rows of `text` whose first cell is an op name: {(op, world, shape): cells}."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < max(key_cols + value_cols) + 1 or not cells[1].isdigit():
            continue
        key = tuple(cells[i] for i in key_cols)
        out[key] = [cells[i] for i in value_cols]
    return out


def number(cell):
    """The leading number of a cell such as '0.974 (0.922-1.085)' or '3.21 (memory)'."""
    m = re.match(r"[-+]?[0-9.]+", cell)
    return float(m.group(0)) if m else None


def spread(values):
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--out")
    parser.add_argument("--only")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="perf_rounds.")
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    report_cmd = [REPORT, "--runs", "1", "--reps", str(args.reps)]
    if args.only:
        report_cmd += ["--only", args.only]
    ours, theirs, loads = [], [], []
    for r in range(args.rounds):
        before = load()
        text = run(report_cmd)
        mpi = ""
        for world in (2, 4):
            mpi += run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(world),
                        "python3", "scripts/mpi_numpy_baseline.py", "--reps", str(args.reps)],
                       env=env)
        loads.append((before, load()))
        with open(os.path.join(out, f"round{r + 1}.txt"), "w") as f:
            f.write(f"load {before} before, {loads[-1][1]} after\n{text}\n{mpi}")
        # op | world | dtype | shape | fused | unfused | roofline | fused/unfused | fused/roofline
        ours.append(rows(text, [0, 1, 2, 3], [4, 5, 7, 8]))
        theirs.append(rows(mpi, [0, 1, 2, 3], [4]))
        print(f"round {r + 1} of {args.rounds}: load {before} -> {loads[-1][1]}", flush=True)
    print(f"\nraw output in {out}; 1-minute load average per round (before -> after): "
          + ", ".join(f"{a} -> {b}" for a, b in loads))
    print("\n| op | world | dtype | shape | fused ms | unfused ms | fused/unfused (per-round "
          "medians) | fused/roofline | MPI + numpy ms | fused / numpy |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for key in ours[0]:
        per = [o[key] for o in ours if key in o]
        fused = [number(p[0]) for p in per]
        unfused = [number(p[1]) for p in per]
        ratio = [number(p[2]) for p in per]
        roof = [number(p[3]) for p in per]
        numpy = [t[key][0] for t in theirs if key in t]
        pairs = [number(o[key][0]) / number(t[key][0]) for o, t in zip(ours, theirs)
                 if key in o and key in t]
        numpy_ms = f"{statistics.median(map(number, numpy)):.2f}" if numpy else "-"
        vs = spread(pairs) if pairs else "-"
        print(f"| {' | '.join(key)} | {statistics.median(fused):.2f} | "
              f"{statistics.median(unfused):.2f} | {spread(ratio)} | {spread(roof)} | "
              f"{numpy_ms} | {vs} |")


if __name__ == "__main__":
    main()
