# jengine on an NVIDIA GPU: `docker build -t jengine .`, then
#   docker run --gpus all -p 8000:8000 -p 50051:50051 -v ~/.cache/huggingface:/home/jengine/.cache/huggingface \
#     jengine Qwen/Qwen3-8B --max-model-len 8192
# (the image's command is `jengine serve`; arguments after the image name are its MODEL and flags)
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

# Ubuntu 24.04's python3 is Python 3.12, the version jengine needs (jax==0.11.2)
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv curl ca-certificates \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/jengine
COPY pyproject.toml README.md ./
COPY jengine ./jengine
COPY server ./server
COPY pallas_kernels ./pallas_kernels
COPY proto ./proto
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir ".[cuda13]"

# Not root: the server needs no privileges; the hub cache and JAX's compilation cache live in its home.
RUN useradd --create-home --uid 1000 jengine
USER 1000
ENV PATH=/opt/venv/bin:$PATH \
    HF_HOME=/home/jengine/.cache/huggingface \
    JENGINE_COMPILATION_CACHE_DIR=/home/jengine/.cache/jengine/jax-cache

# OpenAI HTTP API, gRPC
EXPOSE 8000 50051
# /health answers 200 once the model is loaded and compiled (large models take minutes: the start period)
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
  CMD curl -fsS http://localhost:8000/health || exit 1

ENTRYPOINT ["jengine", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000", "--grpc-port", "50051", "--drain-timeout", "30"]
