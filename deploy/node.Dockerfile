# syntax=docker/dockerfile:1
# pdserve node image (prefill, decode or colocated): torch, Triton and NIXL (UCX bundled).
#   GPU: docker build -f deploy/node.Dockerfile -t pdserve-node .
#   CPU: docker build -f deploy/node.Dockerfile --build-arg BASE_IMAGE=ubuntu:24.04 \
#          --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t pdserve-node:cpu .
# Runs as uid 10001; the chart mounts /tmp (caches) and /dev/shm, the root filesystem stays read-only.
# CUDA 13: the engine imports the nixl_cu13 flavour of NIXL.
ARG BASE_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04

FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG TORCH_VERSION=2.13.0
ARG NIXL_FLAVOUR=cu13
ARG NIXL_VERSION=1.5.1
ARG PIP_VERSION=25.3
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Distribution packages follow the base image's security updates, so they are not pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install "pip==${PIP_VERSION}" \
    # torch first and from its own index: a plain install would pick another CUDA build
    && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md deploy/constraints.txt ./
COPY pdserve ./pdserve
COPY common ./common
COPY loadgen ./loadgen
COPY engine ./engine
COPY spec ./spec
COPY prefill_node ./prefill_node
COPY decode_node ./decode_node
COPY router ./router
# Every dependency pinned by constraints.txt; --no-deps for NIXL: its only declared
# dependencies (torch, numpy) are already here
RUN pip install --constraint constraints.txt ".[node,triton]" \
    && pip install --no-deps "nixl-${NIXL_FLAVOUR}==${NIXL_VERSION}"

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="pdserve-node" \
      org.opencontainers.image.description="pdserve prefill/decode node: torch, Triton, NIXL"
# Triton compiles its small CUDA launchers with the system C compiler at run time.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin pdserve
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=WARN HOME=/tmp
# A stable path for the built-in model pair (the chart's default --model).
RUN mkdir -p /opt/pdserve \
    && ln -s "$(python -c 'import pdserve.models as m; print(m.MODELS_DIR)')" /opt/pdserve/models
USER 10001:10001
WORKDIR /tmp
EXPOSE 30000 8998 29100
ENTRYPOINT ["pdserve"]
CMD ["--help"]
