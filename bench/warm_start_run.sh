#!/usr/bin/env bash
# The warm-start benchmark on the GPU machine, one call: unpack the vLLM 0.26 carry, run bench/warm_start.py (which owns
# the real `kvoffload sidecar`: it SIGKILLs and restarts it for the --sidecar-restart scenario), leave
# JSON, logs and the table in $OUT.
#
#   bash bench/warm_start_run.sh [BUDGET_S]      (repository root, the machine's python3; carry .gpu)
#
# BUDGET_S: wall seconds for the whole script, the unpack included (default 540: a call is at
# most 600).
# Environment: TOKENS (prompt length, default 100000), REPS (rounds of a/b/c, default 3: as many as
# the budget allows), POOL_GIB (sidecar pool, default 32: prompts A and B are 13.1 GB each),
# CPU_GIB (OffloadingConnector's cpu_bytes_to_use in GiB, default 32), SIDECAR_RESTART (1: the
# kill -9 + restart scenario after round 1, default 1), CONFIGS (default kvo-layer,none,offloading),
# WARM_EXTRA (more bench/warm_start.py flags, e.g. --cuda-graphs), MODEL (a folder of
# bench/e2e_models, default llama3-8b).
# Needs .gpu/ (bash bench/gpu_setup.sh builds it).
set -uo pipefail
budget=${1:-540}
OUT=${OUT:-out/warm}
mkdir -p "$OUT"
t_start=$(date +%s)
left() { echo $((budget - ($(date +%s) - t_start))); }

source bench/gpu_env.sh vllm
export PYTHONHASHSEED=${PYTHONHASHSEED:-0}  # block hashes agree across processes (as injected)

{
  date -u
  echo "warm start, budget ${budget}s, image: $native, wheels from .gpu/whl: $need_wheels, commit $(git rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  python3 -c 'import grpc_health.v1.health, kvoffload.v1.pool_pb2; print("grpc_health + kvoffload stubs import")'
  python3 -c 'import vllm; print("vllm", vllm.__version__)' 2>&1 | tail -1
  nproc; free -g | head -2; df -h /dev/shm | tail -1
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

bash bench/build_native.sh | tee -a "$OUT/env.txt"  # the sidecar's C key map for this python

restart=()
[[ ${SIDECAR_RESTART:-1} == 1 ]] && restart=(--sidecar-restart)
b=$(( $(left) - 10 ))
echo "warm_start.py with ${b}s"
# shellcheck disable=SC2086  # WARM_EXTRA is a list of flags
timeout $((b + 30)) python3 bench/warm_start.py --model "bench/e2e_models/${MODEL:-llama3-8b}" \
  --tokens "${TOKENS:-100000}" --reps "${REPS:-3}" --configs "${CONFIGS:-kvo-layer,none,offloading}" \
  --pool-gib "${POOL_GIB:-32}" --cpu-gib "${CPU_GIB:-32}" --pool-dir /dev/shm/kvo-warm \
  --budget-s "$b" --out "$OUT/warm_start.json" --log "$OUT/engines.log" \
  --sidecar-log "$OUT/sidecar.log" ${restart[@]+"${restart[@]}"} ${WARM_EXTRA:-} 2>&1 | tee "$OUT/warm_start.txt"
echo "== warm_start done, rc ${PIPESTATUS[0]}, $(left) s left"
rm -rf /dev/shm/kvo-warm
tail -5 "$OUT/sidecar.log"
