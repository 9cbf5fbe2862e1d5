#!/usr/bin/env bash
# The serving sweep (bench/serve_sweep.py) on the GPU machine, one call: vLLM 0.26 from the carry,
# `vllm serve` per configuration, `vllm bench serve` and bench/serve_chat.py as the clients.
#
#   bash bench/serve_gpu_run.sh [BUDGET_S] [serve_sweep.py flags...]   (repository root; carry .gpu)
#   BENCH=serve_paired.py bash bench/serve_gpu_run.sh [BUDGET_S] [serve_paired.py flags...]
#
# `vllm serve` and `vllm bench serve` need a few packages the GPU image lacks: .gpu/whl2 holds their
# wheels and only the missing ones are installed, into /tmp/site. The image of 2026-11-29 lacks
# seven (~1.6 MB; with the vLLM carry and .gpu/whl the tree then stays under the 64 MiB limit):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .gpu/whl2 uvicorn \
#     httptools prometheus_fastapi_instrumentator model_hosting_container_standards watchfiles \
#     jmespath supervisor
set -uo pipefail
budget=${1:-540}
shift || true
OUT=${OUT:-out/serve}
mkdir -p "$OUT"
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
# GPU 0's clocks, power, use and temperature every 200 ms, as `EPOCH_S, values...` (serve_paired.py
# GPU_STATE_FIELDS; `serve_paired.py modes FILE --gpu-state gpu_state.csv` joins them by time)
to_epoch='import datetime, sys
for line in sys.stdin:
    stamp, _, rest = line.partition(",")
    try:
        t = datetime.datetime.strptime(stamp.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
    except ValueError:
        continue
    print(f"{t:.3f}, {rest.strip()}", flush=True)'
nvidia-smi -i 0 --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,temperature.gpu \
  --format=csv,noheader,nounits -lms 200 2>/dev/null | python3 -u -c "$to_epoch" > "$OUT/gpu_state.csv" &
sampler=$!
# each vCPU's busy/interrupt/steal shares every 200 ms (bench/cpu_sampler.py; `modes
# --engine-trace T --cpu-state cpu_state.jsonl` reads the prefill's own vCPU), and the interrupt
# counters per vCPU before and after
cat /proc/interrupts > "$OUT/interrupts_start.txt" 2>/dev/null
python3 bench/cpu_sampler.py "$OUT/cpu_state.jsonl" &
cpu_sampler=$!
trap 'kill $sampler $cpu_sampler 2>/dev/null' EXIT
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
cat /proc/interrupts > "$OUT/interrupts_end.txt" 2>/dev/null
echo "== sweep rc $rc"
exit "$rc"
