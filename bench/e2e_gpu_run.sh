#!/usr/bin/env bash
# One GPU-machine call for issue 6: unpack the vLLM 0.26 carry, start the real `kvoffload sidecar`,
# run bench/e2e_gpu.py for a phase, leave JSON, logs and tables in $OUT.
#
#   bash bench/e2e_gpu_run.sh PHASE [BUDGET_S]      (repository root, the machine's python3)
#
# PHASE: smoke   small Llama (5 configurations, short sections) + small Gemma-3 hybrid
#        llama   Llama-3-8B shape, 5 configurations, ttft + multiturn + decode
#        hybrid  Gemma-3-12B shape (sliding window + full), 32K pool hit, kvo-eager vs offloading
#        all     llama, then hybrid with what is left
#        final   kvo-eager on Llama (all sections), the hybrid pair, kvo-lazy TTFT if time is left
#        hybrid-mt  the hybrid pair, then Llama-3-8B TTFT 2K/10K + multi-turn (offloading, kvo-eager,
#                   simple)
#        decode-ab  Llama-3-8B 0%-hit decode, none and kvo-eager interleaved over 3 rounds (paired
#                   ratios: drift between rounds cancels)
#        ttft4      Llama-3-8B TTFT 2K/10K/32K: kvo-eager, offloading, kvo-lazy, simple (one call)
#        ttft-mt    Llama-3-8B TTFT 2K/10K + multi-turn: offloading, kvo-eager, simple (--profile)
#        hotpath    Llama-3-8B: cProfile of the main thread over GPU hits and a decode batch, for
#                   kvo-eager, simple, none, kvo-lazy (where a connector's step time goes)
#        layered    the layered-load GPU tests, then Llama-3-8B TTFT 2K/10K/32K: kvo-layer, kvo-eager,
#                   offloading
#        layered2   the layered-load GPU tests, the Gemma-3-12B hybrid 32K pool hit with kvo-layer, and
#                   Llama-3-8B multi-turn: kvo-layer, offloading
#        check-ab   every GPU transfer test, then decode-ab for none and kvo-layer
#        graphs     every GPU transfer test, then Llama-3-8B TTFT 2K/10K/32K with vLLM's compile and
#                   CUDA graphs on (FULL_AND_PIECEWISE): kvo-layer, offloading, simple
#        graphs-ab  Llama-3-8B 0%-hit decode with CUDA graphs on, none and kvo-layer interleaved
#        graphs-hot the hotpath cProfile and a profiled 0%-hit decode with CUDA graphs on
#        graphs-mt  Llama-3-8B multi-turn with CUDA graphs on: kvo-layer, offloading
#        graphs-hybrid  the Gemma-3-12B hybrid 32K pool hit with CUDA graphs on: kvo-layer, offloading
#        mt3        Llama-3-8B multi-turn: offloading, kvo-eager, none (one call, side by side)
#        events-ab  Llama-3-8B multi-turn, kvo-eager without and with --kv-events-config (the host
#                   tier's KV events on), interleaved over 2 rounds
#        mt-hybrid  Llama-3-8B multi-turn for 5 configurations, then the hybrid pair
#        ttft-dec   Llama-3-8B shape, 5 configurations: TTFT 2K/10K/32K then 0%-hit decode, --profile
#        decode-mt  Llama-3-8B shape, 5 configurations: 0%-hit decode then multi-turn, --profile
#        profile Llama-3-8B shape, none / kvo-eager / offloading / kvo-lazy side by side, TTFT at
#                2K and 10K plus decode, with --profile (connector hooks, steps, CPU per thread)
# Hybrid models need more GPU blocks than dense ones for the same max_model_len: vLLM 0.26 sizes each
# sliding-window group for window - 1 + 2 x max_num_batched_tokens (16,384) tokens in flight:
# with two batches in flight (async scheduling), 40,960 tokens take 2,560 + 5 x 2,113 = 13,125
# blocks (measured: 12.82 GiB at 1 MiB a block; gemma3-12b: --gpu-blocks 14000).
# Environment: E2E_CONFIGS (llama phase's configurations), POOL_GIB (sidecar pool, default 48; 32
# for smoke), CPU_GIB (vLLM connectors' cpu_bytes_to_use in GiB, default 48).
# SIZES, REPS: the graphs phase's TTFT prompt lengths (default 2000,10000,32000) and repeats (3).
# E2E_EXTRA: more bench/e2e_gpu.py flags for graphs-hybrid (e.g. --profile).
# CLOCKS=1: sample the GPU's SM clock and power every 0.5 s into $OUT/clocks.csv.
# ROUNDS, CFG_BUDGET: decode-ab's interleaved rounds (3) and seconds per configuration (75).
# RPC_BENCH=1: first run bench/sidecar_rpc.py on this host (its own sidecar; JSON in $OUT).
# BUDGET_S: wall seconds for everything after the unpack (default 540: a call is at most 600).
# Prepare once, here (git-ignored through .git/info/exclude, ~48 MiB, named in the call's carry):
#   echo /.gpu/ >> .git/info/exclude; mkdir -p .gpu/whl
#   cp ../shared/gpu-vllm/vllm026-h100-carry.tar.xz .gpu/
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .gpu/whl grpcio==1.85.1 grpcio-health-checking==1.85.1 \
#     protobuf==7.36.2
# Needs .gpu/vllm026-h100-carry.tar.xz (carry `.gpu`); wheels in .gpu/whl (protobuf 7.36.2, grpcio and
# grpcio-health-checking 1.85.1: the image has grpcio 1.84.0, older than the stubs need) go first.
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

if [[ ${RPC_BENCH:-0} == 1 ]]; then
  timeout 120 python3 bench/sidecar_rpc.py --calls 2000 --pool-dir /dev/shm \
    --out "$OUT/sidecar_rpc_host.json" 2>&1 | tail -20
fi

if [[ ${CLOCKS:-0} == 1 ]]; then
  timeout "$budget" nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
    --format=csv -lms 500 >"$OUT/clocks.csv" 2>&1 &
fi
pool_dir=/dev/shm/kvo-e2e
rm -rf "$pool_dir" && mkdir -p "$pool_dir"
pool_gib=${POOL_GIB:-$([[ $phase == smoke ]] && echo 32 || echo 48)}
cpu_gib=${CPU_GIB:-48}  # vLLM's connectors get the same capacity as the pool
llama_configs=${E2E_CONFIGS:-none,kvo-eager,offloading,simple,kvo-lazy}
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
  llama)
    drive llama3-8b llama3-8b $(( $(left) - 5 )) --configs "$llama_configs"
    ;;
  hybrid)
    drive gemma3-12b gemma3-12b-hybrid $(( $(left) - 5 )) --configs kvo-eager,offloading \
      --sections ttft --sizes 32000 --reps 3 --config-budget-s 110 --gpu-blocks 14000 --fillers 2
    ;;
  all)
    drive llama3-8b llama3-8b $(( $(left) - 205 )) --configs "$llama_configs"
    drive gemma3-12b gemma3-12b-hybrid $(( $(left) - 5 )) --configs kvo-eager,offloading \
      --sections ttft --sizes 32000 --reps 3 --config-budget-s 110 --gpu-blocks 14000 --fillers 2
    ;;
  final)  # what a tight device budget allows: kvoffload on Llama, the hybrid pair, then lazy
    drive llama3-8b llama3-8b $(( $(left) - 170 )) --configs kvo-eager --config-budget-s 135
    drive gemma3-12b gemma3-12b-hybrid $(( $(left) - 5 )) --configs kvo-eager,offloading \
      --sections ttft --sizes 32000 --reps 3 --config-budget-s 70 --gpu-blocks 14000 --fillers 2
    drive llama3-8b-lazy llama3-8b $(( $(left) - 5 )) --configs kvo-lazy --sections ttft
    ;;
  hybrid-mt)
    drive gemma3-12b gemma3-12b-hybrid $(( $(left) - 215 )) --configs kvo-eager,offloading \
      --sections ttft --sizes 32000 --reps 3 --config-budget-s 130 --gpu-blocks 14000 --fillers 2
    drive llama3-8b-mt2 llama3-8b $(( $(left) - 5 )) --configs "${E2E_CONFIGS:-offloading,kvo-eager,simple}" \
      --sections ttft,multiturn --sizes 2000,10000 --reps 3 --config-budget-s 85 --profile
    ;;
  decode-ab)
    drive llama3-8b-decode-ab llama3-8b $(( $(left) - 5 )) --configs "${E2E_CONFIGS:-none,kvo-eager}" \
      --sections decode --sizes 2000 --dec-reps 3 --rounds ${ROUNDS:-3} --config-budget-s ${CFG_BUDGET:-75} --profile
    ;;
  ttft4)
    drive llama3-8b-ttft4 llama3-8b $(( $(left) - 5 )) --configs "${E2E_CONFIGS:-kvo-eager,offloading,kvo-lazy,simple}" \
      --sections ttft --reps 3 --config-budget-s 120 --profile
    ;;
  ttft-mt)
    drive llama3-8b-ttft-mt llama3-8b $(( $(left) - 5 )) --configs "${E2E_CONFIGS:-offloading,kvo-eager,simple}" \
      --sections ttft,multiturn --sizes 2000,10000 --reps 3 --config-budget-s 150 --profile
    ;;
  hotpath)
    drive llama3-8b-hotpath llama3-8b $(( $(left) - 5 )) --configs "${E2E_CONFIGS:-kvo-eager,simple,none,kvo-lazy}" \
      --sections hotpath --sizes 2000 --config-budget-s 100
    ;;
  layered)  # GPU tests of the layered load, then TTFT: layered vs staged loads vs OffloadingConnector
    timeout 150 python3 -m pytest -q -p no:cacheprovider --noconftest -o timeout=90 -m gpu \
      tests/connector/test_transfer_gpu.py -k "layered" 2>&1 | tail -6
    drive llama3-8b-layered llama3-8b $(( $(left) - 5 )) --configs "${E2E_CONFIGS:-kvo-layer,kvo-eager,offloading}" \
      --sections ttft --reps 3 --config-budget-s 150 --profile
    ;;
  layered2)  # the layered-load GPU tests (log in $OUT), the hybrid pool hit and multi-turn with them
    timeout 150 python3 -m pytest -q -p no:cacheprovider --noconftest -o timeout=90 -m gpu \
      tests/connector/test_transfer_gpu.py -k "layered" >"$OUT/tests_layered.txt" 2>&1
    tail -3 "$OUT/tests_layered.txt"
    drive gemma3-12b-layered gemma3-12b-hybrid $(( $(left) - 305 )) --configs kvo-layer \
      --sections ttft --sizes 32000 --reps 3 --config-budget-s 140 --gpu-blocks 14000 --fillers 2
    drive llama3-8b-mt-layered llama3-8b $(( $(left) - 5 )) --configs "${E2E_CONFIGS:-kvo-layer,offloading}" \
      --sections multiturn --sizes 2000 --config-budget-s 150 --profile
    ;;
  check-ab)  # every GPU transfer test (log in $OUT), then 0%-hit decode: none vs kvo-layer, interleaved
    timeout "${GPU_TESTS_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider --noconftest -o timeout=90 --durations=8 -m gpu \
      tests/connector/test_transfer_gpu.py >"$OUT/tests_gpu.txt" 2>&1
    tail -3 "$OUT/tests_gpu.txt"
    drive llama3-8b-decode-ab llama3-8b $(( $(left) - 5 )) --configs "${E2E_CONFIGS:-none,kvo-layer}" \
      --sections decode --sizes 2000 --dec-reps 3 --rounds 3 --config-budget-s 70 --profile
    ;;
  graphs)  # every GPU transfer test (log in $OUT; SKIP_TESTS=1 skips them), then TTFT, graphs on
    if [[ ${SKIP_TESTS:-0} != 1 ]]; then
      timeout "${GPU_TESTS_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider --noconftest -o timeout=90 --durations=8 -m gpu \
        tests/connector/test_transfer_gpu.py >"$OUT/tests_gpu.txt" 2>&1
      tail -3 "$OUT/tests_gpu.txt"
    fi
    drive llama3-8b-graphs llama3-8b $(( $(left) - 5 )) --configs "${E2E_CONFIGS:-kvo-layer,offloading,simple}" \
      --sections ttft --sizes ${SIZES:-2000,10000,32000} --reps ${REPS:-3} --config-budget-s ${CFG_BUDGET:-110} \
      --cuda-graphs --profile
    ;;
  graphs-ab)
    drive llama3-8b-graphs-ab llama3-8b $(( $(left) - 5 )) --configs "${E2E_CONFIGS:-none,kvo-layer}" \
      --sections decode --sizes 2000 --dec-reps 3 --rounds ${ROUNDS:-3} --config-budget-s ${CFG_BUDGET:-75} \
      --cuda-graphs
    ;;
  graphs-hot)  # where a step's host time goes with CUDA graphs on (cProfile + connector hooks)
    drive llama3-8b-graphs-hot llama3-8b $(( $(left) - 5 )) --configs "${E2E_CONFIGS:-none,kvo-layer}" \
      --sections hotpath,decode --sizes 2000 --dec-reps 2 --config-budget-s ${CFG_BUDGET:-150} \
      --cuda-graphs --profile
    ;;
  graphs-mt)  # multi-turn with CUDA graphs on (FULL_AND_PIECEWISE)
    drive llama3-8b-graphs-mt llama3-8b $(( $(left) - 5 )) --configs "${E2E_CONFIGS:-kvo-layer,offloading}" \
      --sections multiturn --sizes 2000 --config-budget-s ${CFG_BUDGET:-200} --cuda-graphs --profile
    ;;
  graphs-hybrid)  # the Gemma-3-12B hybrid 32K pool hit with CUDA graphs on
    drive gemma3-12b-graphs gemma3-12b-hybrid $(( $(left) - 5 )) --configs "${E2E_CONFIGS:-kvo-layer,offloading}" \
      --sections ttft --sizes 32000 --reps 3 --config-budget-s ${CFG_BUDGET:-190} --gpu-blocks 14000 \
      --fillers 2 --cuda-graphs ${E2E_EXTRA:-}
    ;;
  events-ab)
    drive llama3-8b-events-ab llama3-8b $(( $(left) - 5 )) --configs "${E2E_CONFIGS:-kvo-eager,kvo-eager+events=1}" \
      --sections multiturn --sizes 2000 --rounds ${ROUNDS:-2} --config-budget-s ${CFG_BUDGET:-100}
    ;;
  mt3)
    drive llama3-8b-mt3 llama3-8b $(( $(left) - 5 )) --configs "${E2E_CONFIGS:-offloading,kvo-eager,none}" \
      --sections multiturn --sizes 2000 --config-budget-s 150 --profile
    ;;
  mt-hybrid)
    drive llama3-8b-mt llama3-8b $(( $(left) - 290 )) --configs "${E2E_CONFIGS:-none,kvo-eager,offloading,kvo-lazy,simple}" \
      --sections multiturn --sizes 2000 --config-budget-s 90 --profile
    drive gemma3-12b gemma3-12b-hybrid $(( $(left) - 5 )) --configs kvo-eager,offloading \
      --sections ttft --sizes 32000 --reps 3 --config-budget-s 140 --gpu-blocks 14000 --fillers 2
    ;;
  ttft-dec)
    drive llama3-8b-ttft llama3-8b $(( $(left) - 5 )) --configs "${E2E_CONFIGS:-none,kvo-eager,offloading,kvo-lazy,simple}" \
      --sections ttft,decode --reps 3 --dec-reps 2 --config-budget-s 125 --profile
    ;;
  decode-mt)
    drive llama3-8b-decode-mt llama3-8b $(( $(left) - 5 )) --configs "${E2E_CONFIGS:-none,kvo-eager,kvo-lazy,offloading,simple}" \
      --sections decode,multiturn --sizes 2000 --dec-reps 3 --config-budget-s 95 --profile
    ;;
  profile)
    drive llama3-8b-profile llama3-8b $(( $(left) - 5 )) --configs "${E2E_CONFIGS:-none,kvo-eager,offloading,kvo-lazy}" \
      --sections ttft,decode --sizes 2000,10000 --reps 3 --dec-reps 2 --config-budget-s 105 --profile
    ;;
  *) echo "unknown phase $phase (smoke, llama, hybrid, all, final, profile)"; exit 2 ;;
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
