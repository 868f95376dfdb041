# syntax=docker/dockerfile:1.7
# The DejaVu prompt worker over base.Dockerfile's 'engine' target (CPU or CUDA, as that base was built),
# with the default model copied from its 'model' target. Build context: the repository root.
ARG BASE_IMAGE=dejavu-base-engine:cpu
ARG MODEL_IMAGE=dejavu-base-model:cpu

FROM ${MODEL_IMAGE} AS model

FROM ${BASE_IMAGE}
# PyPI, or the host's wheels for `make images BASE=local` (see base.Dockerfile).
ARG PIP_NO_INDEX=0
ARG PIP_FIND_LINKS
COPY services/prompt_worker /src/services/prompt_worker
RUN pip install --no-cache-dir -c /src/requirements/constraints.txt /src/services/prompt_worker
COPY --from=model --chown=10001:10001 /opt/dejavu/models /opt/dejavu/models
WORKDIR /home/dejavu
USER 10001:10001
# Liveness contract (docs/deployment.md): exits 0 iff this worker's process is alive and its lease is fresh.
# The 10 s timeout, as the Kubernetes probes: a Python start on a loaded host can take more than 5 s.
HEALTHCHECK --interval=10s --timeout=10s --start-period=120s --retries=3 \
    CMD ["python", "-m", "dejavu_prompt_worker", "--check"]
CMD ["dejavu-prompt-worker"]
