# syntax=docker/dockerfile:1
# The connector payload image: nothing but /payload, which the injected init container
# `kvoffload-connector-install` copies (`cp -R /payload/. /kvoffload/python`) into an emptyDir that
# the vLLM container gets on PYTHONPATH (connector delivery `initContainer`).
#
#   docker build -f images/connector.Dockerfile -t ghcr.io/kvoffload/kvoffload-connector:<version> .
#
# /payload holds the kvoffload packages (kvoffload_connector and the kvoffload.v1 gRPC stubs) and
# the three dependencies a stock vLLM image lacks or has too old: grpcio, grpcio-health-checking and
# protobuf (our stubs need the protobuf 7 runtime). Everything else the connector imports comes
# from the vLLM image, so the dependencies are installed with --no-deps: PYTHONPATH entries come
# before site-packages, and anything extra here would shadow vLLM's own copy (grpcio's own
# dependency, typing_extensions, included). tests/chart/test_chart_dockerfiles.py checks every
# third-party import of kvoffload_connector against the payload and this line:
# vllm-image-provides: torch numpy vllm cuda yaml prometheus_client typing_extensions
# (`cuda` is cuda-python's cuda.bindings, used by the GPU transfer engine; vLLM's CUDA images carry
# it for their own kernels. It is CUDA-version specific, so the payload must not bring its own.)
#
# Python-version assumption: grpcio is a compiled extension whose wheel is tied to one CPython
# minor version and one platform. The build stage runs the same CPython as the vLLM image
# (VLLM_PYTHON_VERSION, default 3.12: the vllm/vllm-openai images ship Python 3.12) on the same
# platform (build with --platform matching the GPU nodes, e.g. linux/amd64), so pip picks the
# matching manylinux wheel. For a vLLM image on another Python, rebuild with
# --build-arg VLLM_PYTHON_VERSION=3.11 (for example) and tag the result accordingly; a mismatch shows
# up as "ImportError: ... cygrpc" in vLLM, and the connector then treats the pool as absent.

ARG VLLM_PYTHON_VERSION=3.12

FROM python:${VLLM_PYTHON_VERSION}-slim AS build
# Keep within pyproject.toml's ranges (grpcio>=1.66, protobuf>=7.35.1,<8); tests/chart checks it.
ARG GRPCIO_VERSION=1.85.1
ARG PROTOBUF_VERSION=7.36.2
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cli ./cli
COPY sidecar ./sidecar
COPY connector ./connector
COPY operator ./operator
COPY protos/gen ./protos/gen
RUN pip install --target /payload --no-deps . \
 && pip install --target /payload --no-deps --only-binary=:all: \
      "grpcio==${GRPCIO_VERSION}" \
      "grpcio-health-checking==${GRPCIO_VERSION}" \
      "protobuf==${PROTOBUF_VERSION}" \
 && rm -rf /payload/bin \
 && find /payload -name '__pycache__' -prune -exec rm -rf {} + \
 && chmod -R a+rX /payload \
 && PYTHONPATH=/payload python -c "import grpc, grpc_health.v1.health_pb2, kvoffload.v1.pool_pb2_grpc"

# busybox: a static `cp` and nothing else; the payload is plain files.
FROM busybox:1.37
LABEL org.opencontainers.image.title="kvoffload-connector" \
      org.opencontainers.image.description="kvoffload vLLM KV connector payload (/payload)" \
      org.opencontainers.image.source="https://github.com/kvoffload/kvoffload" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /payload /payload
USER 65532:65532
ENTRYPOINT ["cp", "-R", "/payload/.", "/kvoffload/python"]
