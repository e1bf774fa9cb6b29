# syntax=docker/dockerfile:1
# Images of the GEMINI operator, built from this repository:
#   docker build --target operator -t gemini-operator:0.1.0 .   the operator (`gemini operator run`)
#   docker build --target sidecar  -t gemini-sidecar:0.1.0  .   the checkpoint sidecar (`gemini sidecar`)
#   docker build --target trainer  -t gemini-trainer:0.1.0  .   a trainer base image with torch,
#       DeepSpeed, transformers and accelerate whose entrypoint is the launcher
#       (`gemini launch --`): extend it with your training code and set CMD to your training
#       command (e.g. CMD ["python", "train.py"]). Its layers: the dependencies (5.5 GB, the
#       `trainer-deps` stage, which sees only requirements.lock and pyproject.toml), then the
#       project's own files (a thin layer: a code change rebuilds only that).
#   docker build --target examples -t gemini-examples:0.1.0 .   the trainer image with the
#       example training scripts in /app/examples (what examples/geminijob-*.yaml run)
# The dev tools (tools/: local cluster, demo) and their `tools` extra stay out of every image.
# Dependencies come only from requirements.lock (used as pip constraints, so every package is
# the locked version and nothing else is installed); tests/unit/packaging checks this file.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
# The trainer images' third-party layer (torch, its CUDA libraries, DeepSpeed: about 5 GB): the
# `trainer-deps` stage below, or an image of it built earlier (hack/build-images.sh passes one,
# keyed by requirements.lock, pyproject.toml's dependency lists and this file's instructions,
# so a code change rebuilds a thin layer only).
ARG TRAINER_DEPS=trainer-deps

# ---- build: one virtual environment per image, in /opt/gemini -----------------------------------
FROM ${PYTHON_IMAGE} AS build-env
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/gemini
WORKDIR /src
COPY requirements.lock pyproject.toml ./
# The Kubernetes client ships a second, asyncio copy of itself (kubernetes/aio: 68 MB of the
# client's 126 MB) that nothing here imports (tests/unit/packaging/test_dockerfile.py checks).
ENV UNUSED="/opt/gemini/lib/python3.11/site-packages/kubernetes/aio"

FROM build-env AS build-base
# pyproject.toml's `readme` needs the file at install; a stand-in, so that README edits leave
# the images (and their cache key, tools/gemini_local/images.py) as they are.
RUN echo "# GEMINI training operator" > README.md
COPY gemini/ gemini/
COPY cli/ cli/
COPY operator/ operator/
COPY trainer_sidecar/ trainer_sidecar/

FROM build-base AS build-operator
# The operator (and the CLI): the project's own dependencies only, no pip left in the venv.
RUN /opt/gemini/bin/pip install --constraint requirements.lock /src \
    && /opt/gemini/bin/pip uninstall -q -y pip setuptools && rm -rf ${UNUSED}

FROM build-base AS build-sidecar
# The sidecar: plus the `sidecar` extra (S3, checksums, the peer protocol's cryptography).
RUN /opt/gemini/bin/pip install --constraint requirements.lock "/src[sidecar]" \
    && /opt/gemini/bin/pip uninstall -q -y pip setuptools && rm -rf ${UNUSED}

FROM build-env AS build-trainer-deps
# The trainer's third-party dependencies without the project (it sees only requirements.lock
# and pyproject.toml, so a code change leaves this layer cached): the sidecar's, torch and
# DeepSpeed (the `train` extra), the Hugging Face Trainer and Accelerate (the `hf` extra).
RUN /opt/gemini/bin/pip install --constraint requirements.lock $(python -c "import tomllib; \
      p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
      extras = [r for e in ('sidecar', 'train', 'hf') for r in p['optional-dependencies'][e]]; \
      print(*(r for r in p['dependencies'] + extras if not r.startswith(p['name'])))") \
    && rm -rf ${UNUSED}
# DeepSpeed on CPU nodes loads its shared-memory collective op, which it otherwise compiles at
# the first run (no compiler in the image: the training fails). Built here, ahead of time, into
# the installed package (a C++ compiler and Python's headers in this build stage only).
RUN apt-get update -q && apt-get install -y -q --no-install-recommends g++ $(python -c \
      "import os, sysconfig; print('' if os.path.exists(sysconfig.get_paths()['include'] \
      + '/Python.h') else 'python3.11-dev')") >/dev/null \
    && DS_ACCELERATOR=cpu DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=1 /opt/gemini/bin/pip install -q \
       --no-deps --no-build-isolation --force-reinstall --constraint requirements.lock deepspeed \
    && DS_ACCELERATOR=cpu /opt/gemini/bin/python -c "import torch, deepspeed.ops.comm.deepspeed_shm_comm_op"

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

FROM runtime-base AS trainer-deps
COPY --from=build-trainer-deps /opt/gemini /opt/gemini

FROM ${TRAINER_DEPS} AS build-trainer
# The project over the dependencies, alone: the files its install wrote go to /project, the
# trainer image's thin top layer.
WORKDIR /src
COPY --from=build-base /src ./
RUN touch /tmp/before && /opt/gemini/bin/pip install -q --no-deps --constraint requirements.lock . \
    && mkdir /project && cd / && find opt/gemini -type f -newer /tmp/before \
    | tar -cf - -T - | tar -xf - -C /project

FROM ${TRAINER_DEPS} AS trainer
COPY --from=build-trainer /project/opt/gemini /opt/gemini
WORKDIR /home/gemini
USER 65532:65532
# `gemini launch -- CMD` runs the training command and restarts it in place after a failure.
ENTRYPOINT ["gemini", "launch", "--"]

FROM trainer AS examples
COPY examples/train_gpt_zero3.py examples/train_fsdp.py /app/examples/
