#!/usr/bin/env bash
# The slot protocol's cost on the GPU machine: kvoffload at HEAD ("new") against an earlier tree
# ("old", in .old/: `git archive REF connector sidecar protos cli | tar -x -C .old`), one call,
# engines interleaved new old old new ... Each engine gets its own tree's sidecar (the protocols
# differ) on a fresh pool; only PYTHONPATH changes, the bench scripts are HEAD's.
#
#   bash bench/protocol_cost_run.sh e2e|serve [BUDGET_S]     (carry .gpu and .old)
#
# e2e: bench/e2e_gpu.py, kvo-layer, Llama-3-8B shape, CUDA graphs, 10K and 32K pool hits, REPS
# (default 3) prompts per engine, engines until the budget is spent; then
# bench/protocol_cost.py's table (JSON: $OUT/protocol_cost_e2e.json).
# serve: bench/serve_sweep.py, one `vllm serve` (kvo-eager, its own sidecar) per run, servers
# old new new old ..., the prefix workload (24 prefixes x 4,096 tokens) at RATE (default 12)
# requests/s, REQUESTS (300) a server; JSON: $OUT/protocol_cost_serve.json.
set -uo pipefail
phase=${1:-e2e}
budget=${2:-520}
OUT=${OUT:-out/protocol}
W=/tmp/protocol-cost  # everything; $OUT gets the summary, env and one archive (8 files come back)
rm -rf "$W" && mkdir -p "$OUT" "$W"
t_start=$(date +%s)
left() { echo $((budget - ($(date +%s) - t_start))); }
[[ -d .old/connector && -d .old/sidecar ]] || { echo "no .old/ tree"; exit 3; }
source bench/gpu_env.sh vllm
new_pp=$PYTHONPATH
old_pp=/tmp/site:/tmp/vsite:$PWD/.old/connector:$PWD/.old/sidecar:$PWD/.old/protos/gen:$PWD/.old/cli
pp_of() { [[ $1 == new ]] && echo "$new_pp" || echo "$old_pp"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
echo "commit $(git rev-parse --short HEAD 2>/dev/null)" | tee -a "$OUT/env.txt"
bash bench/build_native.sh | tee -a "$OUT/env.txt"
(cd .old && bash ../bench/build_native.sh) | tee -a "$OUT/env.txt"
for t in new old; do
  PYTHONPATH=$(pp_of $t) python3 -c "import kvoffload_sidecar as s, kvoffload_connector as c, vllm
print('$t', s.__file__, c.__file__, 'vllm', vllm.__version__)" 2>&1 | tail -1 | tee -a "$OUT/env.txt"
done

pool_dir=/dev/shm/kvo-pc
sock=$pool_dir/pool.sock
sidecar_pid=
stop_sidecar() {
  [[ -n $sidecar_pid ]] || return 0
  kill "$sidecar_pid" 2>/dev/null
  for _ in $(seq 1 50); do kill -0 "$sidecar_pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$sidecar_pid" 2>/dev/null
  sidecar_pid=
  rm -rf "$pool_dir"
}
trap stop_sidecar EXIT
start_sidecar() {  # start_sidecar TREE LOG
  rm -rf "$pool_dir" && mkdir -p "$pool_dir"
  PYTHONPATH=$(pp_of "$1") python3 -m kvoffload_cli.main sidecar --pool-size "${POOL_GIB:-48}Gi" \
    --pool-dir "$pool_dir" --socket "$sock" --max-namespaces 1 >>"$2" 2>&1 &
  sidecar_pid=$!
  for _ in $(seq 1 300); do
    [[ -S $sock ]] && return 0
    kill -0 "$sidecar_pid" 2>/dev/null || { echo "sidecar ($1) exited"; tail -20 "$2"; return 5; }
    sleep 0.2
  done
  echo "sidecar ($1) socket never appeared"; return 5
}

case $phase in
  e2e)
    order=(new old old new)
    i=0
    while :; do
      t=${order[$((i % 4))]}
      b=$(( $(left) - 15 ))
      (( i == 0 )) && b=$(( b < 260 ? b : 260 ))
      (( i > 0 && b > 150 )) && b=150
      (( b < 75 )) && break
      i=$((i + 1))
      echo "== run $i: $t, budget ${b}s, $(left)s left"
      start_sidecar "$t" "$W/sidecar.$t.log" || break
      PYTHONPATH=$(pp_of "$t") timeout $((b + 30)) python3 bench/e2e_gpu.py \
        --model bench/e2e_models/llama3-8b --socket "$sock" --cpu-gib 48 --budget-s "$b" \
        --configs kvo-layer --sections ttft --sizes 10000,32000 --reps "${REPS:-3}" \
        --cuda-graphs --out "$W/e2e.$t.$i.json" --log "$W/engines.$t.log" >>"$W/driver.log" 2>&1
      echo "   rc $?: $(grep -o '"status": "[^"]*"' "$W/e2e.$t.$i.json" 2>/dev/null | head -1)"
      PYTHONPATH=$(pp_of "$t") python3 -m kvoffload_cli.main stats --socket "$sock" >"$W/stats.$t.$i.txt" 2>&1
      stop_sidecar
    done
    python3 bench/protocol_cost.py e2e "$W/protocol_cost_e2e.json" "$W"/e2e.*.json | tee "$W/table.txt"
    cp "$W/protocol_cost_e2e.json" "$W/table.txt" "$OUT/"
    ;;
  serve)
    python3 - <<'PY' || exit 5
import importlib.util, pathlib, subprocess, sys
mods = {"uvicorn": "uvicorn", "httptools": "httptools", "watchfiles": "watchfiles",
        "prometheus_fastapi_instrumentator": "prometheus_fastapi_instrumentator",
        "model_hosting_container_standards": "model_hosting_container_standards",
        "jmespath": "jmespath", "supervisor": "supervisor"}
wheels = [str(w) for m, d in mods.items() if importlib.util.find_spec(m) is None
          for w in pathlib.Path(".gpu/whl2").glob(f"{d}-*.whl")]
print("serve wheels installed:", [pathlib.Path(w).name.split("-")[0] for w in wheels], flush=True)
if wheels:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--target", "/tmp/site", *wheels], check=True)
PY
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    order=(old new new old)
    i=0
    while :; do
      t=${order[$((i % 4))]}
      b=$(( $(left) - 10 ))
      (( b > ${SERVE_RUN_S:-170} )) && b=${SERVE_RUN_S:-170}
      (( b < 90 )) && break
      i=$((i + 1))
      echo "== server $i: $t, budget ${b}s, $(left)s left"
      PYTHONPATH=$(pp_of "$t") timeout $((b + 40)) python3 bench/serve_sweep.py --budget-s "$b" \
        --out "$W/sweep.$t.$i.json" --start-timeout-s 150 --configs kvo-eager --rates "${RATE:-12}" --random-rates "" \
        --chat-clients "" --num-prefixes 24 --point-s "${POINT_S:-25}" --min-requests "${REQUESTS:-300}" \
        --max-requests "${REQUESTS:-300}" >>"$W/driver.log" 2>&1
      echo "   rc $?: $(grep -m1 -o 'started in [0-9]* s' "$W/driver.log" | tail -1)"
      grep -h 'Traceback\|Error' "$W"/sweep.$t.$i/server.*.log 2>/dev/null | head -5
    done
    python3 bench/protocol_cost.py serve "$W/protocol_cost_serve.json" "$W"/sweep.*.json | tee "$W/table.txt"
    cp "$W/protocol_cost_serve.json" "$W/table.txt" "$OUT/"
    find "$W" -name 'model' -type d -prune -exec rm -rf {} +
    ;;
  *) echo "unknown phase $phase (e2e, serve)"; exit 2 ;;
esac
cp "$OUT/env.txt" "$W/" 2>/dev/null
tar -cJf "$OUT/protocol_cost_$phase.tar.xz" -C /tmp protocol-cost
