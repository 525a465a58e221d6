# syntax=docker/dockerfile:1
# One image for every kai-fractions component; the command picks the part:
#   kai-fractions mirror | node-agent | admission | gate
# Build: docker build -t <registry>/kai-fractions:<version> .  (then --set image.repository=...)
# It runs as a non-root user (10001). The Helm chart runs the node agent as root (runAsUser 0):
# NVML memory limits, compute mode and the MPS daemon need it; libnvidia-ml and the MPS binaries
# come from the host driver through the NVIDIA container runtime, never from this image.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml setup.cfg README.md ./
COPY kai_fractions ./kai_fractions
# Wheels for the package and every dependency, so the runtime stage installs offline.
RUN pip wheel --no-cache-dir --disable-pip-version-check --wheel-dir /wheels .

FROM ${PYTHON_IMAGE} AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# The wheels are bind-mounted from the build stage, so they never land in a layer of this image.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --disable-pip-version-check --no-index --find-links=/wheels \
      kai-fractions \
    && groupadd --system --gid 10001 kai-fractions \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin kai-fractions \
    && kai-fractions --version
USER 10001:10001
LABEL org.opencontainers.image.title="kai-fractions" \
      org.opencontainers.image.description="Enforces KAI Scheduler NvFractions GPU shares on Kubernetes nodes" \
      org.opencontainers.image.licenses="Apache-2.0"
ENTRYPOINT ["kai-fractions"]
CMD ["--help"]
