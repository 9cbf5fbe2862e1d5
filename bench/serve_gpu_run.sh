#!/usr/bin/env bash
# The serving benchmarks on the GPU machine, one call: vLLM 0.26 from the carry, `vllm serve` per
# configuration, `vllm bench serve` and bench/serve_chat.py as the clients.
#
#   bash bench/serve_gpu_run.sh [BUDGET_S] [serve_sweep flags...]   (repository root; carry .gpu)
#   BENCH=serve_paired.py bash bench/serve_gpu_run.sh [BUDGET_S] [serve_paired flags...]
#
# `vllm serve` and `vllm bench serve` need a few packages the GPU image lacks: .gpu/whl2 holds their
# wheels (bash bench/gpu_setup.sh) and only the missing ones are installed, into /tmp/site.
set -uo pipefail
budget=${1:-540}
shift || true
OUT=${OUT:-out/serve}
mkdir -p "$OUT"
bash bench/gpu_setup.sh --check serve || exit 3
source bench/gpu_env.sh vllm
python3 - <<'PY' || exit 5
import importlib.util, pathlib, subprocess, sys
# import name -> distribution (wheel) name
SERVE_MODULES = {"aiohttp": "aiohttp", "aiohappyeyeballs": "aiohappyeyeballs", "aiosignal": "aiosignal",
    "frozenlist": "frozenlist", "multidict": "multidict", "propcache": "propcache", "yarl": "yarl",
    "attr": "attrs", "uvicorn": "uvicorn", "h11": "h11", "click": "click", "uvloop": "uvloop",
    "httptools": "httptools", "prometheus_fastapi_instrumentator": "prometheus_fastapi_instrumentator",
    "model_hosting_container_standards": "model_hosting_container_standards", "watchfiles": "watchfiles",
    "anyio": "anyio", "cloudpickle": "cloudpickle", "psutil": "psutil", "idna": "idna", "httpx": "httpx",
    "httpcore": "httpcore", "jmespath": "jmespath", "supervisor": "supervisor", "certifi": "certifi"}
missing = [d for m, d in SERVE_MODULES.items() if importlib.util.find_spec(m) is None]
wheels = [str(w) for d in missing for w in pathlib.Path(".gpu/whl2").glob(f"{d}-*.whl")]
print("serve packages missing from the image:", missing or "none", flush=True)
if wheels:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--target", "/tmp/site", *wheels], check=True)
PY
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c 'import vllm; print("vllm", vllm.__version__)' 2>&1 | tail -1; nproc; free -g | head -2; df -h /dev/shm | tail -1; } | tee "$OUT/env.txt"
# where the CPUs sit against the GPU (a request's host work runs on one of them)
{ lscpu; nvidia-smi topo -m; } >> "$OUT/env.txt" 2>&1
bash bench/build_native.sh >> "$OUT/env.txt" 2>&1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout $((budget + 30)) python3 "bench/${BENCH:-serve_sweep.py}" --budget-s "$budget" --out "$OUT/sweep.json" "$@" 2>&1 \
  | grep -v '^INFO\|^DEBUG\|^(APIServer\|^(EngineCore' | tail -120
rc=${PIPESTATUS[0]}
# the servers' logs are large: one file keeps each one's error lines and tail (device runs bring
# back few files)
for f in "$OUT"/sweep/server.*.log "$OUT"/sweep/client.*.log; do
  [[ -f $f ]] || continue
  { echo "===== $f"; grep -n 'Error\|error\|Traceback\|WARNING\|Starting vLLM\|Loading\|took\|Graph\|startup\|kvoffload:' "$f" \
      | grep -v 'GET /metrics' | head -60 | cut -c1-400; echo ...; grep -v 'GET /metrics\|POST /v1' "$f" | tail -40 | cut -c1-400; } >> "$OUT/logs.txt"
  rm -f "$f"
done
rm -rf "$OUT/sweep/model"
echo "== sweep rc $rc"
exit "$rc"
