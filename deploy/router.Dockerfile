# syntax=docker/dockerfile:1
# pdserve router image: the OpenAI API in front of the nodes. Slim Python, no torch.
#   docker build -f deploy/router.Dockerfile -t pdserve-router .
# Runs as uid 10001 with a read-only root filesystem (the chart mounts /tmp).
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG PIP_VERSION=25.3
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install "pip==${PIP_VERSION}"
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
# The router extra is torch-free; the build fails if torch came in anyway.
RUN pip install --constraint constraints.txt ".[router]" \
    && python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="pdserve-router" \
      org.opencontainers.image.description="pdserve OpenAI-compatible router (no torch)"
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin pdserve
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp
# The built-in pair's tokenizer at the path the chart's default --tokenizer names.
RUN mkdir -p /opt/pdserve \
    && ln -s "$(python -c 'import pathlib, pdserve; print(pathlib.Path(pdserve.__file__).parent / "models")')" \
       /opt/pdserve/models
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
ENTRYPOINT ["pdserve"]
CMD ["router", "--help"]
