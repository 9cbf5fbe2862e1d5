#!/usr/bin/env bash
# Builds .gpu/ (git-ignored; name it in the device call's `carry`): what bench/gpu_run.sh needs
# on the GPU machine (no network) and its image (Python 3.12, torch 2.11 + CUDA 13, grpcio 1.84,
# no vLLM) lacks. Run it here, once, with pip and the package index (bench/README.md: contents):
#
#   bash bench/gpu_setup.sh            # build what is missing (about 50 MiB in all)
#   bash bench/gpu_setup.sh --check [rpc|vllm|serve]   # only say what is missing (exit 3)
#
# The vLLM 0.26 carry is copied from $GPU_VLLM_DIR (default ../shared/gpu-vllm) when it is there,
# else built from PyPI by that folder's build-carry.sh (~4 min).
set -euo pipefail
cd "$(dirname "$0")/.."
GPU=.gpu
CARRY=$GPU/vllm026-h100-carry.tar.xz
WHEELS=(grpcio==1.85.1 grpcio-health-checking==1.85.1 protobuf==7.36.2)
SERVE_WHEELS=(uvicorn==0.54.0 httptools==0.9.0 prometheus_fastapi_instrumentator==8.1.0
              model_hosting_container_standards==0.1.16 watchfiles==1.3.0 jmespath==1.1.0
              supervisor==4.3.0)
TARGET=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64)

missing() {  # missing [vllm|serve]: print what the wrappers need and .gpu/ lacks
  local what=${1:-all}
  ls $GPU/whl/grpcio-1.85.1-*.whl $GPU/whl/grpcio_health_checking-1.85.1-*.whl \
    $GPU/whl/protobuf-7.36.2-*.whl >/dev/null 2>&1 || echo "$GPU/whl (grpcio, grpcio-health-checking, protobuf)"
  if [[ $what == vllm || $what == serve || $what == all ]]; then
    [[ -s $CARRY ]] || echo "$CARRY (vLLM 0.26)"
  fi
  if [[ $what == serve || $what == all ]]; then
    ls $GPU/whl2/uvicorn-*.whl >/dev/null 2>&1 || echo "$GPU/whl2 (the serve wheels)"
  fi
}

if [[ ${1:-} == --check ]]; then
  gaps=$(missing "${2:-all}")
  if [[ -n $gaps ]]; then
    echo "gpu_setup: .gpu/ lacks what this run needs:" >&2
    sed 's/^/  /' <<<"$gaps" >&2
    echo "  build it on a machine with the package index: bash bench/gpu_setup.sh, then carry .gpu" >&2
    exit 3
  fi
  exit 0
fi

mkdir -p $GPU/whl $GPU/whl2
if [[ ! -s $CARRY ]]; then
  src=${GPU_VLLM_DIR:-../shared/gpu-vllm}
  if [[ -s $src/vllm026-h100-carry.tar.xz ]]; then
    cp "$src/vllm026-h100-carry.tar.xz" "$CARRY"
  elif [[ -x $src/build-carry.sh ]]; then
    "$src/build-carry.sh" $GPU
  else
    echo "gpu_setup: no vLLM carry in $src (set GPU_VLLM_DIR to the folder with build-carry.sh)" >&2
    exit 1
  fi
fi
PIP=${PIP:-python3 -m pip}
$PIP download -q "${TARGET[@]}" -d $GPU/whl "${WHEELS[@]}"
$PIP download -q "${TARGET[@]}" -d $GPU/whl2 "${SERVE_WHEELS[@]}"
du -sh $GPU $CARRY $GPU/whl $GPU/whl2
gaps=$(missing all)
[[ -z $gaps ]] || { echo "gpu_setup: still missing: $gaps" >&2; exit 1; }
