#!/usr/bin/env bash
# Any benchmark, the fault drill or the GPU tests on the GPU machine, one call (repository root,
# the machine's python3; carry .gpu):
#
#   bash bench/gpu_run.sh NAME [BUDGET_S] [NAME's flags...]
#
# NAME: a benchmark (`python -m bench` lists them), warm_start (e2e_gpu's warm-start section at
# its sizes), fault_drill (tests/drill/fault_drill.py),
# gpu_tests (the CUDA transfer tests) or engine_tests [pytest args] (the real-engine tests on
# vLLM 0.26, default test_vllm_engine.py and test_free_order.py: they see what the CPU build
# cannot, async scheduling and CUDA copies). Prepares Python (below: the wheels, vLLM 0.26
# from the carry, the engine in-process; the serve wheels too for serve), builds the
# sidecar's C key map, records the machine in $OUT/env.txt (OUT defaults to out/NAME), then runs
# NAME with its GPU-scale flags below, then the flags given here (later flags win), --out
# $OUT/NAME.json and, where NAME takes one, --budget-s. BUDGET_S (default 540) bounds the whole
# call (a device call is at most 600 s); the run gets SIGINT at its end (pytest still reports).
# Exit status: NAME's; 3 when .gpu/ lacks what NAME needs (bench/gpu_setup.sh).
set -uo pipefail
name=${1:?usage: bash bench/gpu_run.sh NAME [BUDGET_S] [flags...]}
budget=${2:-540}
shift 2 || shift $#
OUT=${OUT:-out/$name}
mkdir -p "$OUT"
t_start=$(date +%s)
left() { echo $((budget - ($(date +%s) - t_start))); }  # the set-up counts against the budget
model=bench/e2e_models/${MODEL:-llama3-8b}
margin=10
run=(python3 -m bench "$name")
out=(--out "$OUT/$name.json")
case $name in
  adoption | sidecar_rpc | transfer) preset=(); env_kind=rpc ;;
  gpu_tests) preset=(); env_kind=rpc out=() run=(python3 -m pytest -q -p no:cacheprovider
      --noconftest -o timeout=90 --durations=8 --maxfail=6 -m gpu tests/connector/test_transfer_gpu.py) ;;
  engine_tests)  # addopts off: the image's pytest lacks pytest-timeout (--strict-markers refuses its marks)
    (( $# )) || set -- tests/connector/test_vllm_engine.py tests/connector/test_free_order.py
    preset=(); out=() run=(python3 -m pytest -q -p no:cacheprovider -o addopts="" -ra) ;;
  e2e_gpu) preset=(--model "$model" --pool-gib 48 --cpu-gib 48 --log "$OUT/engines.log") ;;
  fault_drill)  # the kill phase leaves time for the engine start and the reference run
    margin=$((budget > 400 ? 200 : budget / 2))
    run=(python3 tests/drill/fault_drill.py)  # a drill: a test's runner, not a benchmark
    preset=(--model "$model" --kills 250 --docs 32 --doc-chunks 32 --inflight 8 --rate 20
      --max-model-len 4096 --gpu-memory-utilization 0.4 --pool-size 24Gi
      --sidecar-log "$OUT/sidecar.log") ;;
  warm_start)  # e2e_gpu's warm-start section at its sizes: a 100K-token prompt, a 32 GiB pool
    run=(python3 -m bench e2e_gpu --sections warm_start --configs kvo-layer,none,offloading)
    preset=(--model "$model" --reps 3 --sizes 100000 --max-model-len 102400 --gpu-blocks 0
      --pool-gib 32 --cpu-gib 32 --stall-s 120 --log "$OUT/engines.log") ;;
  serve) preset=(); env_kind=serve; probe=("${1:-}")  # MODE (sweep|paired|replicas) first
    if [[ ${1:-} == replicas ]]; then  # two replicas on one GPU, each half its memory
      shift; run+=(replicas); probe=()
      preset=(--model "$model" --gpu-mem-util 0.45 --pool-gib 16 --prefixes 8
        --prefix-tokens 4096 --suffix-tokens 64 --max-model-len 8192 --warmup-requests 2)
    fi ;;
  *) preset=() ;;
esac
# Python: .gpu/whl's wheels first on sys.path (the image's grpcio 1.84 is older than the stubs
# need, and it lacks grpc_health), this checkout's packages, and (not for rpc) vLLM 0.26 unpacked
# from the carry into /tmp/vsite once per machine, with the engine in-process
bash bench/gpu_setup.sh --check "${env_kind:-vllm}" || exit 3
native=$(python3 -c 'import google.protobuf as p, grpc; print("protobuf", p.__version__, "grpcio", grpc.__version__)' 2>&1 | tail -1)
mkdir -p /tmp/site /tmp/vsite
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .gpu/whl/*.whl || exit 4
export PYTHONPATH=/tmp/site:$PWD/connector:$PWD/sidecar:$PWD/protos/gen:$PWD/cli PYTHONUNBUFFERED=1
if [[ ${env_kind:-vllm} != rpc ]]; then
  [[ -f /tmp/vsite/vllm/__init__.py ]] || tar -xJf .gpu/vllm026-h100-carry.tar.xz -C /tmp/vsite || exit 3
  export PYTHONPATH=/tmp/site:/tmp/vsite:$PWD/connector:$PWD/sidecar:$PWD/protos/gen:$PWD/cli
  export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
fi
if [[ ${env_kind:-} == serve ]]; then  # .gpu/whl2: what `vllm serve` imports beyond the image
  missing=()
  for w in .gpu/whl2/*.whl; do
    d=${w##*/}
    python3 -c 'import importlib.metadata as m, sys; m.distribution(sys.argv[1])' "${d%%-*}" \
      2>/dev/null || missing+=("$w")
  done
  echo "serve packages missing from the image: ${missing[*]:-none}"
  (( ${#missing[@]} == 0 )) || python3 -m pip install -q --no-index --no-deps --no-compile \
    --target /tmp/site "${missing[@]}" || exit 5
fi
export PYTHONHASHSEED=${PYTHONHASHSEED:-0}  # block hashes agree across processes (as injected)
# engine_tests: each engine's core in its own process, as `vllm serve` and default offline use run
# it: an in-process vLLM 0.26 keeps the first engine's worker-side connector in a process global,
# so a test's second engine (a warm restart, "without a connector") would run on the first one's
[[ $name == engine_tests ]] && export VLLM_ENABLE_V1_MULTIPROCESSING=1 PYTHONPATH=$PWD/tests:$PYTHONPATH
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
  date -u
  echo "$name, budget ${budget}s, image: $native, commit $(git rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  python3 -c 'import vllm; print("vllm", vllm.__version__)' 2>&1 | tail -1
  python3 -c 'import cuda.bindings; print("cuda.bindings", cuda.bindings.__version__)' 2>&1 | tail -1
  nproc; free -g | head -2; df -h /dev/shm | tail -1
  echo "shmem THP: $(cat /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>/dev/null)"
} 2>&1 | tee "$OUT/env.txt"
{ lscpu; nvidia-smi topo -m; } >>"$OUT/env.txt" 2>&1  # where the CPUs sit against the GPU
{  # the sidecar's C key map for this python (without a compiler the dict fallback serves)
  read -r inc suffix < <(python3 -c 'import sysconfig as s; print(s.get_paths()["include"], s.get_config_var("EXT_SUFFIX"))')
  cc -O2 -shared -fPIC -I"$inc" sidecar/kvoffload_sidecar/_keymap.c -o "sidecar/kvoffload_sidecar/_keymap$suffix"
  python3 -c 'from kvoffload_sidecar import keymap; print("sidecar key map:", "native" if keymap.NativeKeyMap else "dict")'
} >>"$OUT/env.txt" 2>&1
extra=()
[[ ${out[*]+x} ]] && "${run[@]}" ${probe[@]+"${probe[@]}"} --help 2>/dev/null | grep -q -- --budget-s &&
  extra=(--budget-s $(($(left) - margin)))
echo "== $name: $(left) s left after the set-up"
timeout -s INT -k 20 $(($(left) + 10)) "${run[@]}" ${preset[@]+"${preset[@]}"} "$@" \
  ${out[@]+"${out[@]}"} ${extra[@]+"${extra[@]}"} 2>&1 | tee "$OUT/$name.log" \
  | grep -Ev '^(\([^)]*\) )?(INFO|DEBUG)|jit_monitor' | tail -120
rc=${PIPESTATUS[0]}
# a server's log is large: keep its error lines and tail in logs.txt (device calls bring back few files)
for f in "$OUT"/*/server.*.log "$OUT"/*/client.*.log; do
  [[ -f $f ]] || continue
  { echo "===== $f"; grep -n 'Error\|error\|Traceback\|WARNING\|Starting vLLM\|took\|kvoffload:' "$f" \
      | grep -v 'GET /metrics' | head -60 | cut -c1-400; echo ...; grep -v 'GET /metrics\|POST /v1' "$f" | tail -40 | cut -c1-400; } >>"$OUT/logs.txt"
  rm -f "$f"
done
rm -rf "$OUT"/*/model
echo "== $name rc $rc"
exit "$rc"
