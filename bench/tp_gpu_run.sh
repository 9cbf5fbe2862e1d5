#!/usr/bin/env bash
# The tensor-parallel check on the two-GPU machine (nvidia-h200-x2 / nvidia-h100-x2), one call:
# bench/tp_check.py on vLLM 0.26 from the carry, Llama-3-8B shape (dummy weights, bf16, eager),
# a pool hit against a GPU hit (tokens bit for bit), each rank's pool slice corrupted in turn
# (the output must change), an engine without kvoffload last when the budget allows.
#
#   bash bench/tp_gpu_run.sh [BUDGET_S]      (repository root, the machine's python3; carry .gpu)
#
# Environment: OUT (default out/tp), MODEL (a folder of bench/e2e_models, default llama3-8b),
# TP (2), PROMPTS (4), PROMPT_TOKENS (4000), MAX_TOKENS (16), POOL (8Gi), TP_EXTRA (more flags).
# Exit status: tp_check.py's (1: tokens differ, no full pool hit, or a rank's slice unused), 2 when
# the machine has fewer GPUs than TP, 124 when BUDGET_S ran out.
set -uo pipefail
budget=${1:-290}
OUT=${OUT:-out/tp}
mkdir -p "$OUT"
t_start=$(date +%s)
left() { echo $((budget - ($(date +%s) - t_start))); }
source bench/gpu_env.sh vllm
export PYTHONHASHSEED=${PYTHONHASHSEED:-0}  # block hashes agree across processes (as injected)
# The machine sets these; exported again on purpose (no NVLink multicast / NVLS).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
tp=${TP:-2}
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
{ date -u; nvidia-smi --query-gpu=name --format=csv,noheader; echo "gpus $gpus, TP $tp";
  python3 -c 'import vllm; print("vllm", vllm.__version__)' 2>&1 | tail -1;
  echo "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST=$TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS=$NVSHMEM_DISABLE_NVLS PYTHONHASHSEED=$PYTHONHASHSEED"
} | tee "$OUT/env.txt"
if (( gpus < tp )); then echo "FAILED: TP=$tp needs $tp GPUs, this machine has $gpus"; exit 2; fi
bash bench/build_native.sh | tee -a "$OUT/env.txt"
# shellcheck disable=SC2086  # TP_EXTRA is a list of flags
timeout -k 10 $(( $(left) - 15 )) python3 bench/tp_check.py --model "bench/e2e_models/${MODEL:-llama3-8b}" \
  --tp "$tp" --prompts "${PROMPTS:-4}" --prompt-tokens "${PROMPT_TOKENS:-4000}" \
  --max-tokens "${MAX_TOKENS:-16}" --dtype bfloat16 --gpu-memory-utilization 0.4 \
  --pool-size "${POOL:-8Gi}" --budget-s $(( $(left) - 25 )) --sidecar-log "$OUT/sidecar.log" \
  --out "$OUT/tp_check.json" ${TP_EXTRA:-} 2>&1 | tee "$OUT/tp_check.log" \
  | grep -Ev '^(\([^)]*pid=[0-9]+\) )?(INFO|DEBUG)' | tail -70
rc=${PIPESTATUS[0]}
echo "== tp_check rc $rc, $(left) s left (full log: $OUT/tp_check.log)"
exit "$rc"
