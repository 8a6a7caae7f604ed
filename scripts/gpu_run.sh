#!/bin/bash
# The GPU run (docs/GPU.md; each run's results go to a dated file in docs/results/) in one device
# call: every CUDA test binary and examples 07, 08 and 05,
# then the local-op table, --add and --train of gpu_report beside torch_peer.py, taking turns.
# $1: a folder of the binaries built here (`cargo build --release --features cuda --test ... --example ...`,
# stripped); each part logs to $OUT (the device machine's folder that comes back), so a timeout
# still returns what ran. Run from the repository root: bash scripts/gpu_run.sh probe/bin
: "${OUT:?set OUT to a folder for the logs}"
export DIST_TENSOR_WAIT_TIMEOUT_MS=20000
B=${1:-probe/bin}
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } > $OUT/suite.log 2>&1
for t in cuda_tensor_math cuda_nn cuda_worlds op_suite cuda cuda_dispatch world_device cuda_processes checkpoint; do
  echo "== $t" >> $OUT/suite.log
  timeout 240 $B/$t --test-threads=1 2>&1 | grep -E "^test result|FAILED|panicked|failed|skip" >> $OUT/suite.log
done
{ echo "== 07"; timeout 120 $B/07_transformer_block --device cuda --ranks 3 2>&1 | tail -4
  echo "== 08"; timeout 120 $B/08_train_tp_mlp --device cuda --ranks 2 2>&1 | tail -4
  echo "== 05"; timeout 120 $B/05_tensor_parallel_mlp --processes 2 --device cuda 2>&1 | tail -4
  nvidia-smi --query-gpu=memory.used --format=csv; date -u; } >> $OUT/suite.log 2>&1
for i in 1 2; do
  { date -u; echo "== ours --local $i"; timeout 120 $B/gpu_report --local 2>&1
    echo "== torch --local $i"; timeout 120 python3 benches/gpu/torch_peer.py --local 2>&1; } >> $OUT/local.log
done
for i in 1 2; do
  { echo "== ours --add $i"; timeout 120 $B/gpu_report --add 2>&1
    echo "== torch --add $i"; timeout 120 python3 benches/gpu/torch_peer.py --add 2>&1; } >> $OUT/add.log
done
for i in 1 2 3; do
  { date -u; echo "== ours --train $i"; timeout 150 $B/gpu_report --train 2>&1
    echo "== torch --train $i"; timeout 150 python3 benches/gpu/torch_peer.py --train 2>&1; } >> $OUT/train.log
done
date -u >> $OUT/train.log
