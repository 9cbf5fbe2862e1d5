#!/usr/bin/env bash
# One GPU-machine run: environment facts, the GPU transfer tests, then bench/transfer.py.
# Run from the repository root with the machine's python3 (no .venv there):
#   bash bench/gpu_check.sh [env|tests|bench|all] [extra args for bench/transfer.py]
#   bash bench/gpu_check.sh rpc [extra args for bench/sidecar_rpc.py]   # the sidecar's RPC
#     round trips on the GPU host (absolute times count there); carry .gpu/whl (grpcio 1.85.1,
#     protobuf 7.36.2 for the stubs, grpcio-health-checking; bench/gpu_setup.sh), installed into /tmp/site first.
#   bash bench/gpu_check.sh engine [pytest args]   # the real-engine tests on vLLM 0.26 from the
#     carry (carry .gpu): default tests/connector/test_vllm_engine.py and test_free_order.py,
#     which see what the CPU build cannot (async scheduling, CUDA copies); engine.txt
# GPU_TESTS_TIMEOUT (default 420 s) bounds the test run: one slow machine took over 200 s for 50 of
# the 64 tests, so on an unknown machine run `tests` and `bench` as separate calls (600 s each).
# The engine tests are stopped with SIGINT, so pytest still reports what failed before then.
# Writes env.txt, tests.txt, bench.txt and transfer.json (rpc: rpc.txt and sidecar_rpc.json)
# under $OUT (default ./out/gpu).
set -uo pipefail
mode=${1:-all}
shift || true
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONPATH=connector:sidecar:protos/gen:cli PYTHONUNBUFFERED=1
rc=0
if [[ $mode == rpc ]] && ls .gpu/whl/*.whl >/dev/null 2>&1; then
  mkdir -p /tmp/site
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu/whl/*.whl; then
    export PYTHONPATH=/tmp/site:$PWD/connector:$PWD/sidecar:$PWD/protos/gen:$PWD/cli
  else
    echo "the wheels in .gpu/whl do not fit this python: using its own grpcio and protobuf"
  fi
fi

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
  timeout "${GPU_TESTS_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider --noconftest -o timeout=90 --durations=8 --maxfail=6 -m gpu \
    tests/connector/test_transfer_gpu.py 2>&1 | tee "$OUT/tests.txt" | tail -25
  rc=$((rc | PIPESTATUS[0]))
fi

if [[ $mode == engine ]]; then
  source bench/gpu_env.sh vllm || exit $?
  # each engine's core in its own process, as `vllm serve` and default offline use run it: an
  # in-process vLLM 0.26 keeps the first engine's worker-side connector in a process global, so
  # a test's second engine (warm restart, "without a connector") would run on the first one's
  export VLLM_ENABLE_V1_MULTIPROCESSING=1 PYTHONPATH=$PWD/tests:$PYTHONPATH
  bash bench/build_native.sh >/dev/null 2>&1
  (( $# )) || set -- tests/connector/test_vllm_engine.py tests/connector/test_free_order.py
  # addopts off: the image's pytest lacks pytest-timeout, whose marks --strict-markers refuses
  timeout -s INT -k 30 "${GPU_TESTS_TIMEOUT:-540}" \
    python3 -m pytest -q -p no:cacheprovider -o addopts="" -ra "$@" 2>&1 | grep -v 'jit_monitor' | tee "$OUT/engine.txt" | tail -40
  rc=$((rc | PIPESTATUS[0]))
fi

if [[ $mode == bench || $mode == all ]]; then
  timeout 300 python3 bench/transfer.py --out "$OUT/transfer.json" "$@" 2>&1 | tee "$OUT/bench.txt" | tail -40
  rc=$((rc | PIPESTATUS[0]))
fi
if [[ $mode == rpc ]]; then
  bash bench/build_native.sh  # the sidecar's C key map for this python (else the dict serves)
  timeout 420 python3 bench/sidecar_rpc.py --out "$OUT/sidecar_rpc.json" "$@" 2>&1 |
    tee "$OUT/rpc.txt" | tail -32
  rc=$((rc | PIPESTATUS[0]))
fi
exit $rc
