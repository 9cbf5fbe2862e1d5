#!/usr/bin/env bash
# GPU check of the submit() host-time cut (issue 4), one device call, under 4 minutes:
# submit()'s host work on this machine's CPU (bench/transfer_host.py), the GPU transfer tests,
# then bench/transfer.py for the 16 KiB and 32 KiB cells only, --reps 5 (prints the table).
# Run from the repository root with the machine's python3:
#   bash bench/gpu_check_submit.sh
# Writes transfer_host.json, env.txt, tests.txt, bench.txt, transfer.json under $OUT
# (default ./out/gpu). Without CUDA it runs the host part, says so, and exits 3.
set -uo pipefail
export OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONPATH=connector:sidecar:protos/gen:cli PYTHONUNBUFFERED=1
timeout 90 python3 bench/transfer_host.py --reps 100 --out "$OUT/transfer_host.json" || exit 1
if ! python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check_submit: no CUDA device on this machine: GPU tests and cells not run" >&2
  exit 3
fi
timeout 225 bash bench/gpu_check.sh all --reps 5 --pages 16K,32K
