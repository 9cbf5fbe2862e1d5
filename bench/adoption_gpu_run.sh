#!/usr/bin/env bash
# The GPU host (16 cores, 128 GiB) for issue 18's sidecar numbers, in one call:
#   1. bench/adoption.py inproc: adoption cost per GiB and per million blocks (sparse pools up to
#      256 GiB, 10K-1M blocks);
#   2. bench/adoption.py process: the real sidecar on a real, pre-faulted 64 GiB pool, SIGKILLed
#      and started again: process start -> Stats with the blocks adopted, -> first hit;
#   3. bench/index_ops.py A/B: the pool's hot path with the commit records (this checkout) and
#      without (the sidecar of the commit before issue 18, copied to .gpu/base_sidecar), two
#      rounds in rotated order (skipped when .gpu/base_sidecar is absent).
#
#   bash bench/adoption_gpu_run.sh [BUDGET_S]      (repository root, the machine's python3)
#
# Needs .gpu/whl/grpcio_health_checking-*.whl (the image lacks grpc_health); carry `.gpu`.
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

if [[ -d .gpu/base_sidecar ]]; then
  cp sidecar/kvoffload_sidecar/_keymap*.so .gpu/base_sidecar/kvoffload_sidecar/ 2>/dev/null
  for round in 1 2; do
    order=$([[ $round == 1 ]] && echo "base new" || echo "new base")
    for v in $order; do
      (( $(left) < 40 )) && break
      pp=$PYTHONPATH
      [[ $v == base ]] && pp=$PWD/.gpu/base_sidecar:$PYTHONPATH
      echo "== index_ops $v (round $round)"
      PYTHONPATH=$pp timeout 120 python3 bench/index_ops.py --batch 1,64,1024 --policy lru \
        --seconds 2 --out "$OUT/index_ops_${v}_$round.json" 2>&1 | grep -E '^lru|^policy'
    done
  done
fi
echo "== done, $(left) s left"
