# The preprocessing service: a slim CPU image (no CUDA libraries).
#   docker build -f docker/service.Dockerfile -t disttrain-service .
FROM python:3.11-slim-bookworm
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    # the planner's numba kernels are compiled at build time into the image (`warm` below), so a
    # pod's first step costs no compilation; the directory is the runtime user's (numba checks it is writable)
    NUMBA_CACHE_DIR=/app/numba-cache
WORKDIR /app
# torch from PyTorch's CPU index first: PyPI's torch==2.13.0 is the CUDA build (GBs of nvidia libs)
COPY requirements requirements
RUN pip install --index-url https://download.pytorch.org/whl/cpu -r requirements/torch.txt
COPY pyproject.toml README.md ./
COPY preprocess_service preprocess_service
COPY trainer trainer
COPY disttrain_api disttrain_api
COPY disttrain_tools disttrain_tools
# the service's dependencies at the lock's exact versions (a constraint: the dev tools stay out)
RUN pip install -c requirements/lock.txt ".[service]"
RUN useradd --uid 10001 --create-home disttrain \
    && python -m preprocess_service warm && chown -R 10001 /app/numba-cache
USER 10001
# gRPC, Prometheus /metrics
EXPOSE 50051 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s CMD ["python", "-m", "preprocess_service", "health"]
ENTRYPOINT ["python", "-m", "preprocess_service"]
CMD ["serve"]
