# Sourced by the GPU-machine wrappers (bench/gpu_run.sh, gpu_check.sh): the one place that prepares Python there.
#
#   source bench/gpu_env.sh [rpc|vllm|serve]      (repository root, carry `.gpu`)
#
# Installs .gpu/whl's wheels into /tmp/site first on sys.path (the image's grpcio 1.84 is older than
# the generated stubs need; grpc_health is not in the image), puts this checkout's packages on
# PYTHONPATH and, with `vllm` or `serve`, unpacks vLLM 0.26 from .gpu/vllm026-h100-carry.tar.xz into /tmp/vsite
# (once per machine) with the engine in-process. Sets `native` (the image's own protobuf/grpcio)
# and `need_wheels` (yes/no) for the wrapper's env line. Exits 3 when .gpu/ lacks what the run needs
# (bench/gpu_setup.sh builds it) or 4 when the wheels do not install.
bash bench/gpu_setup.sh --check "${1:-rpc}" || exit 3
native=$(python3 -c 'import google.protobuf as p, grpc; print("protobuf", p.__version__, "grpcio", grpc.__version__)' 2>&1 | tail -1)
need_wheels=no
mkdir -p /tmp/site
if ls .gpu/whl/*.whl >/dev/null 2>&1; then
  need_wheels=yes
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu/whl/*.whl || exit 4
fi
export PYTHONPATH=/tmp/site:$PWD/connector:$PWD/sidecar:$PWD/protos/gen:$PWD/cli PYTHONUNBUFFERED=1
if [[ ${1:-} == vllm || ${1:-} == serve ]]; then
  mkdir -p /tmp/vsite
  [[ -f /tmp/vsite/vllm/__init__.py ]] || tar -xJf .gpu/vllm026-h100-carry.tar.xz -C /tmp/vsite || exit 3
  export PYTHONPATH=/tmp/site:/tmp/vsite:$PWD/connector:$PWD/sidecar:$PWD/protos/gen:$PWD/cli
  export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
fi
