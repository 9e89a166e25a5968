# The trainer: CUDA torch (PyPI's torch==2.13.0 wheel bundles the CUDA runtime; the host needs an
# NVIDIA driver and the container toolkit). The same image runs on CPU nodes with gloo.
#   docker build -f docker/trainer.Dockerfile -t disttrain-trainer .
FROM python:3.11-slim-bookworm
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/numba-cache
WORKDIR /app
COPY requirements requirements
RUN pip install -r requirements/torch.txt
COPY pyproject.toml README.md ./
# the client and the model pipeline only: the service's dependencies stay out (pyproject extras)
COPY trainer trainer
COPY disttrain_api disttrain_api
RUN pip install -c requirements/lock.txt ".[trainer]" && python -c "import torch, trainer.train; assert torch.version.cuda, 'expected the CUDA build of torch'"
RUN useradd --uid 10001 --create-home disttrain
USER 10001
# torchrun rendezvous
EXPOSE 29500
ENTRYPOINT ["torchrun"]
