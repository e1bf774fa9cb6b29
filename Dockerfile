# syntax=docker/dockerfile:1
# Images of the GEMINI operator, built from this repository:
#   docker build --target operator -t gemini-operator:0.1.0 .   the operator (`gemini operator run`)
#   docker build --target sidecar  -t gemini-sidecar:0.1.0  .   the checkpoint sidecar (`gemini sidecar`)
#   docker build --target trainer  -t gemini-trainer:0.1.0  .   a trainer base image with torch,
#       DeepSpeed, transformers and accelerate whose entrypoint is the launcher
#       (`gemini launch --`): extend it with your training code and set CMD to your training
#       command (e.g. CMD ["python", "train.py"]).
#   docker build --target examples -t gemini-examples:0.1.0 .   the trainer image with the
#       example training scripts in /app/examples (what examples/geminijob-*.yaml run)
# The dev tools (tools/: local cluster, demo) and their `tools` extra stay out of every image.
# Dependencies come only from requirements.lock (used as pip constraints, so every package is
# the locked version and nothing else is installed); tests/unit/packaging checks this file.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# ---- build: one virtual environment per image, in /opt/gemini -----------------------------------
FROM ${PYTHON_IMAGE} AS build-base
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/gemini
WORKDIR /src
COPY requirements.lock pyproject.toml README.md ./
COPY gemini/ gemini/
COPY cli/ cli/
COPY operator/ operator/
COPY trainer_sidecar/ trainer_sidecar/

# The Kubernetes client ships a second, asyncio copy of itself (kubernetes/aio: 68 MB of the
# client's 126 MB) that nothing here imports (tests/unit/packaging/test_dockerfile.py checks).
ENV UNUSED="/opt/gemini/lib/python3.11/site-packages/kubernetes/aio"

FROM build-base AS build-operator
# The operator (and the CLI): the project's own dependencies only, no pip left in the venv.
RUN /opt/gemini/bin/pip install --constraint requirements.lock /src \
    && /opt/gemini/bin/pip uninstall -q -y pip setuptools && rm -rf ${UNUSED}

FROM build-base AS build-sidecar
# The sidecar: plus the `sidecar` extra (S3, checksums, the peer protocol's cryptography).
RUN /opt/gemini/bin/pip install --constraint requirements.lock "/src[sidecar]" \
    && /opt/gemini/bin/pip uninstall -q -y pip setuptools && rm -rf ${UNUSED}

FROM build-base AS build-trainer
# The sidecar's dependencies plus torch and DeepSpeed (the `train` extra) and the Hugging Face
# Trainer/Accelerate integration (the `hf` extra: transformers, accelerate).
RUN /opt/gemini/bin/pip install --constraint requirements.lock "/src[train,hf]" \
    && rm -rf ${UNUSED}

# ---- runtime images ------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime-base
# A fixed non-root user; the Helm chart's securityContext runs as the same uid.
RUN groupadd --system --gid 65532 gemini \
    && useradd --system --uid 65532 --gid 65532 --home-dir /home/gemini --create-home \
       --shell /usr/sbin/nologin gemini
ENV PATH=/opt/gemini/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /home/gemini

FROM runtime-base AS operator
COPY --from=build-operator /opt/gemini /opt/gemini
USER 65532:65532
# Prometheus metrics (GET /metrics) on the chart's default port.
EXPOSE 9090
ENTRYPOINT ["gemini", "operator", "run"]

FROM runtime-base AS sidecar
COPY --from=build-sidecar /opt/gemini /opt/gemini
USER 65532:65532
ENTRYPOINT ["gemini", "sidecar"]

FROM runtime-base AS trainer
COPY --from=build-trainer /opt/gemini /opt/gemini
USER 65532:65532
# `gemini launch -- CMD` runs the training command and restarts it in place after a failure.
ENTRYPOINT ["gemini", "launch", "--"]

FROM trainer AS examples
COPY examples/train_gpt_zero3.py examples/train_fsdp.py /app/examples/
