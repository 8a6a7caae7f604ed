#!/usr/bin/env python3
"""Plants known bugs in a scratch copy of the tree, one at a time, and runs the test that must
catch each: a mutation the tests do not notice is a test that cannot fail.

    python3 scripts/mutate.py            # every mutation (long: one release build of the
                                         # library and one test binary per mutation)
    python3 scripts/mutate.py --list     # the table
    python3 scripts/mutate.py --only softmax-no-max,split-units-chunk
    python3 scripts/mutate.py --quick    # the few rows CI runs (QUICK), one of each kind of bug

The working tree is never touched: its tracked and untracked (not ignored) files are copied to a
temporary directory, each mutation is applied there (its pattern must occur exactly once) and
undone after its test. The builds share a target directory (MUTATE_TARGET_DIR, default the
repository's own `target/`) and are incremental (CARGO_INCREMENTAL=1), so each rebuild is short. Before any mutation, every test named
in the table runs on the unmutated copy and must pass: a test that fails anyway catches nothing.

Each row ends as `caught` (the test failed), `MISSED` (it passed), `no build` (the mutant does not
compile: a bad row, not a catch), or `not run` (it needs a feature whose system packages are
missing here, such as `mpi` without mpicc). The exit status is 0 only when every row that ran
was caught.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

# Launcher entries of src/shmem/job_env.rs's FAMILIES, in its order.
OPENMPI_MPICH = """    Family {
        launcher: "OpenMPI",
        rank: "OMPI_COMM_WORLD_RANK",
        size: "OMPI_COMM_WORLD_SIZE",
        local_rank: Some("OMPI_COMM_WORLD_LOCAL_RANK"),
        local_size: Some("OMPI_COMM_WORLD_LOCAL_SIZE"),
    },
    Family {
        launcher: "MPICH/Hydra",
        rank: "PMI_RANK",
        size: "PMI_SIZE",
        local_rank: Some("MPI_LOCALRANKID"),
        local_size: Some("MPI_LOCALNRANKS"),
    },
"""
SLURM = """    Family {
        launcher: "Slurm",
        rank: "SLURM_PROCID",
        size: "SLURM_NTASKS",
        local_rank: Some("SLURM_LOCALID"),
        // Slurm writes tasks per node as "4(x2)": the local rank alone tells a second host.
        local_size: None,
    },
"""

# (name, file, pattern, replacement, cargo test arguments, features)
# The arguments name one test target and a filter; `--exact` is added when the filter is a full
# test path. Patterns are literal text.
MUTATIONS = [
    # The three the suite missed (issue 31).
    (
        "softmax-no-max",
        "src/tensor/activation.rs",
        "*e = (*e - max).exp();",
        "*e = e.exp();",
        ["--test", "numeric_edges", "softmax_subtracts_the_row_max_so_large_logits_do_not_overflow"],
        None,
    ),
    (
        "split-units-chunk",
        "src/dist_tensor/split.rs",
        "Ok(array_split(len / unit, world).iter().map(|u| u * unit).collect())",
        "{ let units = len / unit; let per = units.div_ceil(world); "
        "Ok((0..world).map(|r| per.min(units.saturating_sub(r * per)) * unit).collect()) }",
        ["--test", "dist_api", "split_units_cut_as_array_split_not_as_chunk"],
        None,
    ),
    (
        "slurm-before-openmpi",
        "src/shmem/job_env.rs",
        # The Slurm entry of FAMILIES moved up, before OpenMPI's.
        OPENMPI_MPICH + SLURM,
        SLURM + OPENMPI_MPICH,
        ["--lib", "shmem::job_env::launcher_precedence::openmpi_wins_over_slurm_when_both_are_set"],
        None,
    ),
    # One per module changed in the last two series.
    (
        "gelu-tanh-derivative",
        "src/nn/activation.rs",
        "[0.5, 1.0, SQRT_2_OVER_PI, 0.044715, 3.0 * 0.044715]",
        "[0.5, 1.0, SQRT_2_OVER_PI, 0.044715, 0.044715]",
        ["--test", "nn_layers", "mlp_against_one_rank_f64_reference"],
        None,
    ),
    (
        "adam-no-bias-correction",
        "src/nn/optim/adam.rs",
        "let step = acc(lr / (1.0 - beta1.powi(t)));",
        "let step = acc(lr);",
        ["--test", "nn_training", "loss_curves_match_one_rank_f64"],
        None,
    ),
    (
        "few-rows-last-tile-dropped",
        "src/tensor/few_rows.rs",
        "for (t, tile) in packed.chunks_exact(MAX_ROWS * TILE_COLS).enumerate() {",
        "for (t, tile) in packed.chunks_exact(MAX_ROWS * TILE_COLS).enumerate()"
        ".take(tiles.saturating_sub(1)) {",
        ["--lib", "tensor::few_rows::tests::matches_f64_reference"],
        None,
    ),
    (
        "lent-block-held-counts-free",
        "src/shmem/lent.rs",
        ".filter_map(|(i, b)| Arc::get_mut(b).map(|_| i))",
        ".map(|(i, _)| i)",
        ["--test", "processes", "held_outputs_keep_their_values_and_outlive_the_world_as_processes"],
        None,
    ),
    (
        "all-to-all-even-destination",
        "src/device/host/all_to_all.rs",
        "dst: ((a * g_total + g_off) * bm + b) * s * c,",
        "dst: ((a * g_total + src * g) * bm + b) * s * c,",
        [
            "--test",
            "processes",
            "collectives_and_fused_ops_as_processes_give_the_same_bits_as_threads_at_worlds_1_to_4",
        ],
        None,
    ),
    (
        "transposed-weight-copy-short-block",
        "src/device/host/plan.rs",
        "for i in i0..(i0 + BLOCK_I).min(rows) {",
        "for i in i0..(i0 + BLOCK_J).min(rows) {",
        ["--test", "nn_fused_ops", "shard_by_shard_path_with_transposed_weights"],
        None,
    ),
    (
        "array-split-last-ranks-more",
        "src/tensor/split.rs",
        "(0..parts).map(|i| len / parts + usize::from(i < len % parts)).collect()",
        "(0..parts).map(|i| len / parts + usize::from(parts - 1 - i < len % parts)).collect()",
        ["--test", "dist_api", "split_sizes_match_hand_written_tables"],
        None,
    ),
    (
        "layer-norm-one-pass-variance",
        "src/tensor/norm.rs",
        "centered.extend(x.iter().map(|&v| (v - mean) * (v - mean)));",
        "centered.extend(x.iter().map(|&v| v * v - mean * mean));",
        ["--test", "numeric_edges", "norms_of_rows_far_from_zero_and_near_the_largest_half_values"],
        None,
    ),
    (
        "futex-wakes-one",
        "src/shmem/sync.rs",
        "futex::wake(&self.doorbell, futex::Flags::empty(), i32::MAX as u32)",
        "futex::wake(&self.doorbell, futex::Flags::empty(), 1)",
        ["--test", "notify_wakes", "a_notify_wakes_every_program_blocked_on_the_signal_at_once"],
        None,
    ),
    # Issue 60: the indexing ops' gradients and tie order (tests/autograd_select.rs).
    (
        "index-select-grad-overwrites",
        "src/tensor/select.rs",
        "|s, &x| *s += x.to_acc()",
        "|s, &x| *s = x.to_acc()",
        ["--test", "autograd_select", "index_select_repeated_first_axis::gradcheck_f64"],
        None,
    ),
    (
        "cumsum-grad-not-reversed",
        "src/tensor/scan.rs",
        'self.scan("Var::cumsum backward", axis, true)',
        'self.scan("Var::cumsum backward", axis, false)',
        ["--test", "autograd_select", "cumsum_prime_length::gradcheck_f64"],
        None,
    ),
    (
        "topk-ties-highest-index-first",
        "src/tensor/top.rs",
        "rank(lane[i], lane[j]).then(i.cmp(&j))",
        "rank(lane[i], lane[j]).then(j.cmp(&i))",
        [
            "--test",
            "autograd_select",
            "topk_and_argmax_break_ties_by_the_lowest_index_and_the_gradient_follows",
        ],
        None,
    ),
    # The one training stack (issue 60).
    (
        "zero1-resume-forgets-moments",
        "src/mesh/zero.rs",
        "*self.adam.slots_mut() = Slots::from_flat(vec![slice]);",
        "{ drop(slice); self.adam.reset(); }",
        ["--test", "training", "a_run_resumed_on_another_world_and_mesh_gives_the_unbroken_losses"],
        None,
    ),
    (
        "data-parallel-keeps-local-grads",
        "src/mesh/replicas.rs",
        "            Ok(order)\n        })?;\n        set_grads(&params, &order, mean)",
        "            Ok(order)\n        })?;\n        drop((order, mean));\n        Ok(())",
        ["--test", "training", "a_run_resumed_on_another_world_and_mesh_gives_the_unbroken_losses"],
        None,
    ),
    (
        "grad-norm-sums-replicated-per-rank",
        "src/nn/module.rs",
        "Ok((all_reduce(rank, &[sharded])?[0] + replicated).sqrt())",
        "Ok(all_reduce(rank, &[sharded + replicated])?[0].sqrt())",
        ["--test", "gpt_training", "curves_match_one_rank_f64_at_every_world_in_both_forms"],
        None,
    ),
    (
        "loss-scaler-skips-on-its-own-rank",
        "src/nn/scaler.rs",
        "let finite = all_reduce(rank, &[bad])?[0] == 0.0;",
        "let finite = bad == 0.0;",
        ["--test", "training", "an_overflow_on_one_rank_skips_the_step_on_every_rank"],
        None,
    ),
    (
        "mpi-proxy-signals-first",
        "src/shmem/mpi/proxy.rs",
        "RecvOp { requests, action: signal.map(|(offset, op)| Action::Signal(offset, op)) }",
        "{ if let Some((offset, op)) = signal { self.act(source, Action::Signal(offset, op)); } "
        "RecvOp { requests, action: None } }",
        ["--test", "mpi", "own_nodes_over_tcp_4_ranks_every_op_matches_threads"],
        "mpi",
    ),
    # Decode (issue 54): the flash-decode's combine and local records, the one-shot all_reduce.
    (
        "flash-decode-combine-drops-rank-0",
        "src/device/host/flash_decode.rs",
        "let Some(token) = *token else { continue };",
        "let Some(token) = *token else { continue }; if src == 0 && tokens.len() > 1 { continue; }",
        ["--test", "flash_decode", "matches_f64_on_worlds_of_1_to_8_with_uneven_and_empty_key_shards"],
        None,
    ),
    (
        "decode-records-wrong-kv-head",
        "src/tensor/decode_attention.rs",
        "scores[head * keys + j] = dot(query, &row[head / g * d..][..d]);",
        "scores[head * keys + j] = dot(query, &row[head % h.kv_heads * d..][..d]);",
        ["--test", "flash_decode", "matches_f64_on_worlds_of_1_to_8_with_uneven_and_empty_key_shards"],
        None,
    ),
    (
        "lse-combine-no-rescale",
        "src/tensor/decode_attention.rs",
        "*a = *a * old + o * new;",
        "*a = *a + o * new;",
        ["--test", "flash_decode", "keys_beyond_one_chunk_on_some_ranks"],
        None,
    ),
    (
        "one-shot-all-reduce-mean",
        "src/collectives/all_reduce.rs",
        "Shots::One => reduce(Op::AllReduce, rank, input, 1, Pieces::Whole, ReduceOp::Sum, out),",
        "Shots::One => reduce(Op::AllReduce, rank, input, 1, Pieces::Whole, ReduceOp::Mean, out),",
        ["--test", "collectives", "one_shot_and_two_shot_all_reduce_give_the_same_bits"],
        None,
    ),
    (
        "flash-decode-agreement-leaves-out-dv",
        "src/fused/flash_decode.rs",
        'for (i, what) in ["batch", "heads", "kv_heads", "d", "dv"].into_iter().enumerate() {',
        'for (i, what) in ["batch", "heads", "kv_heads", "d"].into_iter().enumerate() {',
        [
            "--test",
            "flash_decode",
            "each_agreed_field_differing_on_the_last_rank_alone_is_named_on_every_rank",
        ],
        None,
    ),
    (
        "moe-agreement-leaves-out-top-k",
        "src/fused/moe_dispatch.rs",
        'for (i, what) in ["hidden", "experts", "top_k"].into_iter().enumerate() {',
        'for (i, what) in ["hidden", "experts"].into_iter().enumerate() {',
        [
            "--test",
            "moe",
            "each_agreed_field_differing_on_the_last_rank_alone_is_named_on_every_rank",
        ],
        None,
    ),
    (
        "moe-receive-buffer-sized-by-own-rows",
        "src/device/host/moe_dispatch.rs",
        "(plan.most_received() * h).max(1)",
        "(plan.received(me) * h).max(1)",
        ["--test", "moe", "matches_f64_on_worlds_of_1_to_8_every_dtype"],
        None,
    ),
    (
        "moe-rows-placed-ignoring-earlier-sources",
        "src/device/host/moe_dispatch.rs",
        "before + (0..s).map(|x| self.counts[x][e]).sum::<usize>()",
        "before + (0..s.min(1)).map(|x| self.counts[x][e]).sum::<usize>()",
        ["--test", "moe", "matches_f64_on_worlds_of_1_to_8_every_dtype"],
        None,
    ),
    (
        "moe-combine-first-slot-weight",
        "src/device/host/moe_combine.rs",
        "let w = weight[slot].to_acc();",
        "let w = weight[t * k].to_acc();",
        ["--test", "moe", "matches_f64_on_worlds_of_1_to_8_every_dtype"],
        None,
    ),
    (
        "route-ties-to-the-higher-expert",
        "src/tensor/route.rs",
        ".then(a.cmp(&b))",
        ".then(b.cmp(&a))",
        ["--test", "moe", "ties_go_to_the_lower_expert_and_nan_is_never_skipped"],
        None,
    ),
    (
        "moe-grad-slot-rows-unweighted",
        "src/autograd/ops/moe.rs",
        "per_slot.extend(d_out.iter().map(|x| T::from_acc(ws * x.to_acc())));",
        "per_slot.extend(d_out.iter().map(|x| T::from_acc(x.to_acc())));",
        ["--test", "moe", "gradients_of_x_weights_and_experts_match_the_f64_reference"],
        None,
    ),

]


# What `.ci/run` runs on every CI run (a few minutes): an agreement that leaves a field out, a
# value taken from one rank where every rank's counts, a flag read locally where it must be
# global, and a collective's form that changes its result.
QUICK = [
    "flash-decode-agreement-leaves-out-dv",
    "flash-decode-combine-drops-rank-0",
    "loss-scaler-skips-on-its-own-rank",
    "one-shot-all-reduce-mean",
]


def run(cmd, cwd, env, timeout):
    start = time.time()
    try:
        out = subprocess.run(
            cmd, cwd=cwd, env=env, timeout=timeout, capture_output=True, text=True
        )
        return out.returncode, out.stdout + out.stderr, time.time() - start
    except subprocess.TimeoutExpired:
        return None, "", time.time() - start


def copy_tree(repo, dest):
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for f in files:
        if not f:
            continue
        src = os.path.join(repo, f.decode())
        if not os.path.isfile(src):
            continue  # deleted in the working tree
        dst = os.path.join(dest, f.decode())
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(src, dst)


def cargo_args(test, features):
    target, filt = test[:-1], test[-1]
    args = ["cargo", "test", "--release"] + target
    if features:
        args += ["--features", features]
    # A full path (with ::) or a test function name: exact match.
    return args + ["--", filt, "--exact"]


def tests_ran(text):
    """How many tests the run started (0 when the filter matched none)."""
    return sum(int(n) for n in re.findall(r"running (\d+) tests?", text))


def why(text):
    """The first failure message of a test run, on one line."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "panicked at" in line:
            rest = " ".join(l.strip() for l in lines[i + 1 : i + 3] if l.strip())
            return rest[:150]
    return ""


def feature_missing(features):
    if features == "mpi":
        return None if shutil.which("mpicc") and shutil.which("mpirun") else "needs mpicc and mpirun"
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print the table and stop")
    parser.add_argument("--only", help="comma-separated names of the mutations to run")
    parser.add_argument("--quick", action="store_true", help="only the rows CI runs (QUICK)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per test run")
    opts = parser.parse_args()
    table = MUTATIONS
    if opts.only or opts.quick:
        wanted = set(opts.only.split(",")) if opts.only else set(QUICK)
        table = [m for m in MUTATIONS if m[0] in wanted]
        unknown = wanted - {m[0] for m in table}
        if unknown:
            sys.exit(f"unknown mutations: {sorted(unknown)}")
    if opts.list:
        for name, file, _, _, test, features in table:
            extra = f" (feature {features})" if features else ""
            print(f"{name:38} {file:28} {' '.join(test)}{extra}")
        return 0
    repo = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True
    ).stdout.strip()
    env = dict(os.environ)
    env["CARGO_TARGET_DIR"] = os.environ.get("MUTATE_TARGET_DIR", os.path.join(repo, "target"))
    # Incremental release builds: each mutant changes one function, most of the crate's codegen
    # units are reused (the dependencies are built once, as usual).
    env.setdefault("CARGO_INCREMENTAL", "1")
    scratch = tempfile.mkdtemp(prefix="dist-tensor-mutate-")
    started = time.time()
    rows = []
    try:
        copy_tree(repo, scratch)
        # Every test on the unmutated copy first.
        for test, features in sorted({(tuple(m[4]), m[5]) for m in table}):
            if feature_missing(features):
                continue
            code, text, secs = run(cargo_args(list(test), features), scratch, env, opts.timeout)
            if code != 0 or tests_ran(text) == 0:
                print(text[-4000:])
                sys.exit(f"baseline: {' '.join(test)} does not pass unmutated ({code}); stopping")
            print(f"baseline ok  {' '.join(test)}  ({secs:.0f} s)", flush=True)
        for name, file, pattern, replacement, test, features in table:
            missing = feature_missing(features)
            if missing:
                rows.append((name, file, test, f"not run ({missing})", 0.0))
                print(f"{name}: not run ({missing})", flush=True)
                continue
            path = os.path.join(scratch, file)
            original = open(path).read()
            if original.count(pattern) != 1:
                sys.exit(f"{name}: the pattern occurs {original.count(pattern)} times in {file}")
            open(path, "w").write(original.replace(pattern, replacement))
            try:
                build = cargo_args(test, features)
                build = build[: build.index("--")] + ["--no-run"]
                code, text, _ = run(build, scratch, env, opts.timeout)
                if code != 0:
                    result, secs, reason = "no build", 0.0, ""
                    print(text[-2000:])
                else:
                    code, text, secs = run(cargo_args(test, features), scratch, env, opts.timeout)
                    reason = why(text)
                    if code is None:
                        result = "caught (timed out)"
                    elif code != 0:
                        result = "caught"
                    else:
                        result = "MISSED" if tests_ran(text) > 0 else "no test ran"
            finally:
                open(path, "w").write(original)
            rows.append((name, file, test, result, secs))
            print(f"{name}: {result} ({secs:.0f} s) {reason}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print()
    print(f"| {'mutation':36} | {'file':26} | {'test':70} | result |")
    print(f"|{'-' * 38}|{'-' * 28}|{'-' * 72}|--------|")
    for name, file, test, result, _ in rows:
        print(f"| {name:36} | {file:26} | {' '.join(test):70} | {result} |")
    ran = [r for r in rows if not r[3].startswith("not run")]
    caught = [r for r in ran if r[3].startswith("caught")]
    print(f"\ncaught {len(caught)} of {len(ran)} run ({len(rows) - len(ran)} not run)", end="")
    print(f" in {(time.time() - started) / 60:.0f} minutes")
    return 0 if len(caught) == len(ran) else 1


if __name__ == "__main__":
    sys.exit(main())
