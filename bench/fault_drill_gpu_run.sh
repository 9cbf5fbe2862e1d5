#!/usr/bin/env bash
# The fault drill (bench/fault_drill.py) at full scale on the GPU machine, one call: vLLM 0.26 from the
# carry, the engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), the real sidecar SIGKILLed and
# restarted at random moments, every output compared with an engine without kvoffload.
#
#   bash bench/fault_drill_gpu_run.sh [BUDGET_S]      (repository root, the machine's python3; carry .gpu)
#
# Environment: MODEL (a folder of bench/e2e_models, default llama3-8b), KILLS (default 250), DOCS (32),
# DOC_CHUNKS (32: 2,048-token documents at the connector's default 64-token chunks), INFLIGHT (8),
# RATE (requests a second, default 20), POOL (sidecar pool, default 24Gi), DRILL_EXTRA (more flags).
set -uo pipefail
budget=${1:-560}
OUT=${OUT:-out/drill}
mkdir -p "$OUT"
t_start=$(date +%s)
left() { echo $((budget - ($(date +%s) - t_start))); }
source bench/gpu_env.sh vllm
export PYTHONHASHSEED=${PYTHONHASHSEED:-0}  # block hashes agree across processes (as injected)
{ date -u; nvidia-smi --query-gpu=name --format=csv,noheader; python3 -c 'import vllm; print("vllm", vllm.__version__)' 2>&1 | tail -1; } | tee "$OUT/env.txt"
bash bench/build_native.sh | tee -a "$OUT/env.txt"
kill_budget=$(( $(left) - 200 ))  # engine start, the reference run and the comparison after it
echo "kill phase budget ${kill_budget}s"
# shellcheck disable=SC2086  # DRILL_EXTRA is a list of flags
timeout $(( $(left) - 5 )) python3 bench/fault_drill.py --model "bench/e2e_models/${MODEL:-llama3-8b}" \
  --kills "${KILLS:-250}" --docs "${DOCS:-32}" --doc-chunks "${DOC_CHUNKS:-32}" \
  --inflight "${INFLIGHT:-8}" --rate "${RATE:-20}" --max-model-len 4096 \
  --gpu-memory-utilization 0.4 --pool-size "${POOL:-24Gi}" --budget-s "$kill_budget" \
  --sidecar-log "$OUT/sidecar.log" --out "$OUT/fault_drill_gpu.json" ${DRILL_EXTRA:-} 2>&1 \
  | grep -v '^INFO\|^DEBUG' | tail -60
echo "== drill rc ${PIPESTATUS[0]}, $(left) s left"
