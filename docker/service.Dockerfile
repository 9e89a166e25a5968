# The preprocessing service: a slim CPU image (no CUDA libraries).
#   docker build -f docker/service.Dockerfile -t disttrain-service .
FROM python:3.11-slim-bookworm
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    # numba compiles the planner's kernels once and caches them; the app directory is read-only
    NUMBA_CACHE_DIR=/tmp/numba-cache
WORKDIR /app
# torch from PyTorch's CPU index first: PyPI's torch==2.13.0 is the CUDA build (GBs of nvidia libs)
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md ./
COPY preprocess_service preprocess_service
COPY trainer trainer
COPY disttrain_api disttrain_api
COPY disttrain_tools disttrain_tools
RUN pip install ".[service]" \
    # torchaudio 2.11.0 is a CUDA build; without its CUDA extension libraries the CPU parts we use work
    && python -c "import importlib.util, pathlib; lib = pathlib.Path(importlib.util.find_spec('torchaudio').origin).parent / 'lib'; [p.unlink() for p in lib.glob('*.so')]" \
    && python -c "import torch, torchaudio; assert not torch.version.cuda"
RUN useradd --uid 10001 --create-home disttrain
USER 10001
# gRPC, Prometheus /metrics
EXPOSE 50051 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s CMD ["python", "-m", "preprocess_service", "health"]
ENTRYPOINT ["python", "-m", "preprocess_service"]
CMD ["serve"]
