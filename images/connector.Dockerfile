# syntax=docker/dockerfile:1
# The connector payload image: nothing but /payload, which the injected init container
# `kvoffload-connector-install` copies (`cp -R /payload/. /kvoffload/python`) into an emptyDir at
# the front of the vLLM container's PYTHONPATH (connector delivery `initContainer`, the default:
# stock vLLM images work as they are).
#
#   docker build -f images/connector.Dockerfile -t ghcr.io/kvoffload/kvoffload-connector:<version> .
#
# Layout (images/build_payload.py builds it; tests/chart/test_chart_dockerfiles.py builds the same
# layout for the local Python and imports from it):
#   /payload/kvoffload_connector, /payload/kvoffload   ONLY our packages at top level, so nothing
#                                                      on PYTHONPATH can shadow a vLLM package;
#   /payload/_kvoffload_deps/cp310 ... cp313          grpcio, grpcio-health-checking, protobuf,
#                                                      binary wheels per CPython minor; never on
#                                                      PYTHONPATH: the connector appends the one
#                                                      matching its Python to the END of sys.path,
#                                                      so the image's own copies win.
# Everything else the connector imports comes from the vLLM image. tests/chart checks every
# third-party import of kvoffload_connector against the payload and this line:
# vllm-image-provides: torch numpy vllm cuda yaml prometheus_client typing_extensions msgspec
# (`cuda` is cuda-python's cuda.bindings, used by the GPU transfer engine; vLLM's CUDA images carry
# it for their own kernels. It is CUDA-version specific, so the payload must not bring its own.)
# Platform: the deps are manylinux2014_x86_64 wheels (PAYLOAD_PLATFORM for other nodes, e.g.
# manylinux2014_aarch64); the payload itself is plain files, so the final image is any-arch.

ARG BUILD_PYTHON_VERSION=3.12

FROM python:${BUILD_PYTHON_VERSION}-slim AS build
# Keep within pyproject.toml's ranges (grpcio>=1.66, protobuf); tests/chart checks it.
ARG GRPCIO_VERSION=1.85.1
ARG PROTOBUF_VERSION=7.36.2
ARG PAYLOAD_PYTHONS="3.10 3.11 3.12 3.13"
ARG PAYLOAD_PLATFORM=manylinux2014_x86_64
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY connector/kvoffload_connector ./connector/kvoffload_connector
COPY protos/gen/kvoffload ./protos/gen/kvoffload
COPY images/build_payload.py ./images/build_payload.py
RUN python images/build_payload.py /payload --source . --pythons ${PAYLOAD_PYTHONS} \
      --platform "${PAYLOAD_PLATFORM}" \
      --grpcio "${GRPCIO_VERSION}" --protobuf "${PROTOBUF_VERSION}" \
 && chmod -R a+rX /payload \
 && PYTHONPATH=/payload python -c "import kvoffload_connector.guard as g; g.add_payload_deps(); import grpc, grpc_health.v1.health_pb2, kvoffload.v1.pool_pb2_grpc"

# busybox: a static `cp` and nothing else; the payload is plain files.
FROM busybox:1.37
LABEL org.opencontainers.image.title="kvoffload-connector" \
      org.opencontainers.image.description="kvoffload vLLM KV connector payload (/payload)" \
      org.opencontainers.image.source="https://github.com/kvoffload/kvoffload" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /payload /payload
USER 65532:65532
ENTRYPOINT ["cp", "-R", "/payload/.", "/kvoffload/python"]
