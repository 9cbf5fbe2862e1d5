#!/usr/bin/env bash
# The offline end-to-end benchmark (bench/e2e_gpu.py) on the GPU machine, one call: unpack the
# vLLM 0.26 carry, start the real `kvoffload sidecar`, run one phase, leave JSON, logs and tables
# in $OUT.
#
#   bash bench/e2e_gpu_run.sh PHASE [BUDGET_S]      (repository root, the machine's python3; carry .gpu)
#
# PHASE: smoke      small Llama and small Gemma-3 hybrid, short sections, then the 8B shape's
#                   10K/32K pool hit (does everything start and hit?)
#        ttft       the GPU transfer tests (SKIP_TESTS=1 skips them), then Llama-3-8B TTFT at
#                   2K/10K/32K (cold, GPU hit, pool hit), CUDA graphs on: kvo-layer, offloading,
#                   simple
#        multiturn  Llama-3-8B multi-turn (64 conversations, 8K shared system prompt), graphs on
#        hybrid     the Gemma-3-12B hybrid shape (sliding window + full attention), 32K pool hit
#        decode     Llama-3-8B 0%-hit decode, none and kvo-layer interleaved over ROUNDS rounds
#        events     Llama-3-8B multi-turn, kvo-eager with and without --kv-events-config
# Hybrid models need more GPU blocks than dense ones for the same max_model_len: vLLM 0.26 sizes each
# sliding-window group for window - 1 + 2 x max_num_batched_tokens (16,384) tokens in flight
# (gemma3-12b: --gpu-blocks 14000).
# Environment: E2E_CONFIGS (the phase's configurations, in start order: rotate them between
# calls), POOL_GIB (sidecar pool, default 48; 32 for smoke), CPU_GIB (vLLM connectors'
# cpu_bytes_to_use in GiB, default 48), SIZES and REPS (ttft's prompt lengths and repeats),
# ROUNDS and CFG_BUDGET (interleaved rounds, seconds per configuration), E2E_EXTRA (more
# bench/e2e_gpu.py flags).
# BUDGET_S: wall seconds for everything after the unpack (default 540: a call is at most 600).
# Needs .gpu/ (bash bench/gpu_setup.sh builds it): the vLLM carry and .gpu/whl.
set -uo pipefail
phase=${1:-smoke}
budget=${2:-540}
OUT=${OUT:-out/e2e}
mkdir -p "$OUT"
t_start=$(date +%s)
left() { echo $((budget - ($(date +%s) - t_start))); }

# The image's own versions (the generated stubs need protobuf >= 7.35 and grpcio >= 1.85.1).
source bench/gpu_env.sh vllm

{
  date -u
  echo "phase $phase, budget ${budget}s, image: $native, wheels from .gpu/whl: $need_wheels, commit $(git rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  python3 -c 'import google.protobuf as p, grpc; print("protobuf", p.__version__, "from", p.__file__, "grpc", grpc.__version__)'
  python3 -c 'import grpc_health.v1.health, kvoffload.v1.pool_pb2; print("grpc_health + kvoffload stubs import")'
  python3 -c 'import vllm; print("vllm", vllm.__version__)' 2>&1 | tail -1
  nproc; free -g | head -2; df -h /dev/shm | tail -1
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

bash bench/build_native.sh | tee -a "$OUT/env.txt"  # the sidecar's C key map for this python

pool_dir=/dev/shm/kvo-e2e
rm -rf "$pool_dir" && mkdir -p "$pool_dir"
pool_gib=${POOL_GIB:-$([[ $phase == smoke ]] && echo 32 || echo 48)}
cpu_gib=${CPU_GIB:-48}  # vLLM's connectors get the same capacity as the pool
python3 -m kvoffload_cli.main sidecar --pool-size "${pool_gib}Gi" --pool-dir "$pool_dir" \
  --socket "$pool_dir/pool.sock" --max-namespaces 1 >"$OUT/sidecar.log" 2>&1 &
sidecar_pid=$!
trap 'kill $sidecar_pid 2>/dev/null; sleep 1; kill -9 $sidecar_pid 2>/dev/null; rm -rf "$pool_dir"' EXIT
for _ in $(seq 1 300); do
  [[ -S $pool_dir/pool.sock ]] && break
  kill -0 $sidecar_pid 2>/dev/null || { echo "sidecar exited:"; tail -20 "$OUT/sidecar.log"; exit 5; }
  sleep 0.2
done
[[ -S $pool_dir/pool.sock ]] || { echo "sidecar socket never appeared"; tail -20 "$OUT/sidecar.log"; exit 5; }
echo "sidecar up (pid $sidecar_pid, pool ${pool_gib} GiB) after $(( $(date +%s) - t_start )) s"

drive() {  # drive NAME MODEL BUDGET ARGS...: one driver run, its JSON and log in $OUT
  local name=$1 model=$2 b=$3
  shift 3
  (( b < 70 )) && { echo "skip $name: ${b}s left"; return 0; }
  timeout $((b + 30)) python3 bench/e2e_gpu.py --model "bench/e2e_models/$model" \
    --socket "$pool_dir/pool.sock" --cpu-gib "$cpu_gib" --budget-s "$b" \
    --out "$OUT/$name.json" --log "$OUT/engines.log" "$@"
  echo "== $name done, rc $?, $(left) s left"
}

case $phase in
  smoke)
    drive smoke-llama llama-small $(( $(left) - 160 )) --sizes 2000,10000 --reps 2 \
      --config-budget-s 45 --filler-tokens 12000 --gpu-blocks 1500 --max-model-len 16384 \
      --cpu-gib 4 --mt-convs 8 --mt-system 2048 --mt-turn 256 --mt-reply 8 --mt-turns 2 \
      --dec-batch 8 --dec-tokens 32 --dec-reps 1
    drive smoke-hybrid gemma3-small-hybrid $(( $(left) - 95 )) --configs kvo-eager,offloading \
      --sections ttft --sizes 8000 --reps 2 --config-budget-s 45 --filler-tokens 12000 \
      --gpu-blocks 6500 --max-model-len 16384 --cpu-gib 4
    drive smoke-8b llama3-8b $(( $(left) - 5 )) --configs kvo-eager --sections ttft \
      --sizes 10000,32000 --reps 2
    ;;
  ttft)
    if [[ ${SKIP_TESTS:-0} != 1 ]]; then
      timeout "${GPU_TESTS_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider --noconftest -o timeout=90 --durations=8 -m gpu \
        tests/connector/test_transfer_gpu.py >"$OUT/tests_gpu.txt" 2>&1
      tail -3 "$OUT/tests_gpu.txt"
    fi
    drive llama3-8b-ttft llama3-8b $(( $(left) - 5 )) --configs "${E2E_CONFIGS:-kvo-layer,offloading,simple}" \
      --sections ttft --sizes "${SIZES:-2000,10000,32000}" --reps "${REPS:-3}" --config-budget-s "${CFG_BUDGET:-110}" \
      --cuda-graphs ${E2E_EXTRA:-}
    ;;
  multiturn)
    drive llama3-8b-multiturn llama3-8b $(( $(left) - 5 )) --configs "${E2E_CONFIGS:-kvo-layer,simple,offloading}" \
      --sections multiturn --sizes 2000 --config-budget-s "${CFG_BUDGET:-165}" --cuda-graphs ${E2E_EXTRA:-}
    ;;
  hybrid)
    drive gemma3-12b-hybrid gemma3-12b-hybrid $(( $(left) - 5 )) --configs "${E2E_CONFIGS:-kvo-layer,offloading}" \
      --sections ttft --sizes 32000 --reps 3 --config-budget-s "${CFG_BUDGET:-190}" --gpu-blocks 14000 \
      --fillers 2 --cuda-graphs ${E2E_EXTRA:-}
    ;;
  decode)
    drive llama3-8b-decode llama3-8b $(( $(left) - 5 )) --configs "${E2E_CONFIGS:-none,kvo-layer}" \
      --sections decode --sizes 2000 --dec-reps 3 --rounds "${ROUNDS:-3}" --config-budget-s "${CFG_BUDGET:-75}" \
      --cuda-graphs ${E2E_EXTRA:-}
    ;;
  events)
    drive llama3-8b-events llama3-8b $(( $(left) - 5 )) --configs "${E2E_CONFIGS:-kvo-eager,kvo-eager+events=1}" \
      --sections multiturn --sizes 2000 --rounds "${ROUNDS:-2}" --config-budget-s "${CFG_BUDGET:-100}"
    ;;
  *) echo "unknown phase $phase (smoke, ttft, multiturn, hybrid, decode, events)"; exit 2 ;;
esac

python3 - "$OUT" <<'EOF' | tee "$OUT/tables.txt"
import json, sys, pathlib
for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(p.read_text())
    print(f"### {p.name}")
    print("\n".join(r.get("tables", [])))
EOF
python3 -m kvoffload_cli.main stats --socket "$pool_dir/pool.sock" 2>&1 | head -20
tail -5 "$OUT/sidecar.log"
