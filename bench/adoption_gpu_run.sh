#!/usr/bin/env bash
# The sidecar's restart numbers on the GPU host (16 cores, 128 GiB), one call:
#   1. bench/adoption.py inproc: adoption cost per GiB and per million blocks (sparse pools up to
#      256 GiB, 10K-1M blocks);
#   2. bench/adoption.py process: the real sidecar on a real, pre-faulted 64 GiB pool, SIGKILLed
#      and started again: process start -> Stats with the blocks adopted, -> first hit.
#
#   bash bench/adoption_gpu_run.sh [BUDGET_S]      (repository root, the machine's python3)
#
# Needs .gpu/whl (bash bench/gpu_setup.sh; the image lacks grpc_health); carry `.gpu`.
set -uo pipefail
budget=${1:-540}
OUT=${OUT:-out/adopt}
mkdir -p "$OUT"
t_start=$(date +%s)
left() { echo $((budget - ($(date +%s) - t_start))); }
source bench/gpu_env.sh
{ date -u; nproc; free -g | head -2; python3 -c 'import sys, numpy; print(sys.version.split()[0], numpy.__version__)'; } | tee "$OUT/env.txt"
bash bench/build_native.sh | tee -a "$OUT/env.txt"

timeout $(( $(left) / 3 )) python3 bench/adoption.py --sizes-gib 1,8,64,256 \
  --blocks 10000,100000,1000000 --reps 3 --out "$OUT/adoption_inproc.json" 2>&1 | grep -v '^20'
echo "== inproc done, $(left) s left"
timeout $(( $(left) / 2 )) python3 bench/adoption.py --mode process --sizes-gib 64 \
  --blocks 32768,1000000 --reps 3 --out "$OUT/adoption_process.json" 2>&1 | grep -v '^20'
echo "== process done, $(left) s left"

echo "== done, $(left) s left"
