#!/usr/bin/env bash
# Any benchmark, or the fault drill, on the GPU machine, one call (repository root, the machine's
# python3; carry .gpu):
#
#   bash bench/gpu_run.sh NAME [BUDGET_S] [NAME's flags...]
#
# Prepares Python (bench/gpu_env.sh: the wheels, vLLM 0.26 from the carry, the engine in-process;
# the serve wheels too for serve), builds the sidecar's C key map, records the machine in
# $OUT/env.txt (OUT defaults to out/NAME), then runs `python3 -m bench NAME` (fault_drill:
# `python3 tests/drill/fault_drill.py`) with NAME's GPU-scale flags below, then the flags given
# here (later flags win), --out $OUT/NAME.json and, where NAME takes one, --budget-s. BUDGET_S
# (default 540) bounds the whole call (a device call is at most 600 s). Exit status: the
# benchmark's; 3 when .gpu/ lacks what NAME needs (bench/gpu_setup.sh).
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
case $name in
  adoption) preset=(); env_kind=rpc ;;
  e2e_gpu) preset=(--model "$model" --pool-gib 48 --cpu-gib 48 --log "$OUT/engines.log") ;;
  fault_drill)  # the kill phase leaves time for the engine start and the reference run
    margin=$((budget > 400 ? 200 : budget / 2))
    run=(python3 tests/drill/fault_drill.py)  # a drill: a test's runner, not a benchmark
    preset=(--model "$model" --kills 250 --docs 32 --doc-chunks 32 --inflight 8 --rate 20
      --max-model-len 4096 --gpu-memory-utilization 0.4 --pool-size 24Gi
      --sidecar-log "$OUT/sidecar.log") ;;
  warm_start)
    preset=(--model "$model" --tokens 100000 --reps 3 --configs kvo-layer,none,offloading
      --pool-gib 32 --cpu-gib 32 --pool-dir /dev/shm/kvo-warm
      --log "$OUT/engines.log" --sidecar-log "$OUT/sidecar.log") ;;
  serve) preset=(); env_kind=serve; probe=("${1:-}") ;;  # MODE (sweep|paired) first
  *) preset=() ;;
esac
source bench/gpu_env.sh "${env_kind:-vllm}"
if [[ ${env_kind:-} == serve ]]; then  # what `vllm serve` and `vllm bench serve` import and the image lacks, from .gpu/whl2
  python3 - <<'PY' || exit 5
import importlib.util, pathlib, subprocess, sys
NEEDED = {"aiohttp": "aiohttp", "aiohappyeyeballs": "aiohappyeyeballs", "aiosignal": "aiosignal",
    "frozenlist": "frozenlist", "multidict": "multidict", "propcache": "propcache", "yarl": "yarl",
    "attr": "attrs", "uvicorn": "uvicorn", "h11": "h11", "click": "click", "uvloop": "uvloop",
    "httptools": "httptools", "prometheus_fastapi_instrumentator": "prometheus_fastapi_instrumentator",
    "model_hosting_container_standards": "model_hosting_container_standards", "watchfiles": "watchfiles",
    "anyio": "anyio", "cloudpickle": "cloudpickle", "psutil": "psutil", "idna": "idna", "httpx": "httpx",
    "httpcore": "httpcore", "jmespath": "jmespath", "supervisor": "supervisor", "certifi": "certifi"}
missing = [d for m, d in NEEDED.items() if importlib.util.find_spec(m) is None]
wheels = [str(w) for d in missing for w in pathlib.Path(".gpu/whl2").glob(f"{d}-*.whl")]
print("serve packages missing from the image:", missing or "none", flush=True)
if wheels:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--target", "/tmp/site", *wheels], check=True)
PY
fi
export PYTHONHASHSEED=${PYTHONHASHSEED:-0}  # block hashes agree across processes (as injected)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
  date -u
  echo "$name, budget ${budget}s, image: $native, wheels: $need_wheels, commit $(git rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  python3 -c 'import vllm; print("vllm", vllm.__version__)' 2>&1 | tail -1
  nproc; free -g | head -2; df -h /dev/shm | tail -1
} 2>&1 | tee "$OUT/env.txt"
{ lscpu; nvidia-smi topo -m; } >>"$OUT/env.txt" 2>&1  # where the CPUs sit against the GPU
bash bench/build_native.sh >>"$OUT/env.txt" 2>&1  # the sidecar's C key map for this python
extra=()
"${run[@]}" ${probe[@]+"${probe[@]}"} --help 2>/dev/null | grep -q -- --budget-s &&
  extra=(--budget-s $(($(left) - margin)))
echo "== $name: $(left) s left after the set-up"
timeout -k 10 $(($(left) + 20)) "${run[@]}" ${preset[@]+"${preset[@]}"} "$@" \
  --out "$OUT/$name.json" ${extra[@]+"${extra[@]}"} 2>&1 | tee "$OUT/$name.log" \
  | grep -Ev '^(\([^)]*\) )?(INFO|DEBUG)' | tail -120
rc=${PIPESTATUS[0]}
# a server's log is large: keep its error lines and tail in logs.txt (device calls bring back few files)
for f in "$OUT"/*/server.*.log "$OUT"/*/client.*.log; do
  [[ -f $f ]] || continue
  { echo "===== $f"; grep -n 'Error\|error\|Traceback\|WARNING\|Starting vLLM\|took\|kvoffload:' "$f" \
      | grep -v 'GET /metrics' | head -60 | cut -c1-400; echo ...; grep -v 'GET /metrics\|POST /v1' "$f" | tail -40 | cut -c1-400; } >>"$OUT/logs.txt"
  rm -f "$f"
done
rm -rf "$OUT"/*/model /dev/shm/kvo-warm
echo "== $name rc $rc"
exit "$rc"
