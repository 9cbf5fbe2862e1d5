#!/usr/bin/env bash
# One GPU-machine run: environment facts, the GPU transfer tests, then bench/transfer.py.
# Run from the repository root with the machine's python3 (no .venv there):
#   bash bench/gpu_check.sh [env|tests|bench|all] [extra args for bench/transfer.py]
# Writes env.txt, tests.txt, bench.txt and transfer.json under $OUT (default ./out/gpu).
set -uo pipefail
mode=${1:-all}
shift || true
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONPATH=connector:sidecar:protos/gen:cli PYTHONUNBUFFERED=1
rc=0

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
  python3 -c 'import sys, torch, numpy; print(sys.version.split()[0], torch.__version__, torch.version.cuda, numpy.__version__)'
  python3 -c 'import cuda.bindings, cuda.core; print("cuda.bindings", cuda.bindings.__version__)' 2>&1
  python3 -c 'import grpc, google.protobuf; print("grpc", grpc.__version__)' 2>&1 | tail -1
  nvcc --version | tail -2
  df -h /dev/shm /tmp | tail -2
  nproc; free -g | head -2; ls -d /sys/devices/system/node/node* 2>/dev/null | wc -l; cat /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>/dev/null
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [[ $mode == tests || $mode == all ]]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider --noconftest -o timeout=90 --maxfail=6 -m gpu \
    tests/connector/test_transfer_gpu.py 2>&1 | tee "$OUT/tests.txt" | tail -25
  rc=$((rc | PIPESTATUS[0]))
fi

if [[ $mode == bench || $mode == all ]]; then
  timeout 300 python3 bench/transfer.py --out "$OUT/transfer.json" "$@" 2>&1 | tee "$OUT/bench.txt" | tail -40
  rc=$((rc | PIPESTATUS[0]))
fi
exit $rc
