# syntax=docker/dockerfile:1.7
# The DejaVu controller: REST gateway + scheduler. No torch: it builds on base.Dockerfile's 'python' target.
# It tokenizes and counts layers, so it takes the model's config and tokenizer files (not its weights)
# from base.Dockerfile's 'model' target. Build context: the repository root (see `make image-controller`).
ARG BASE_IMAGE=dejavu-base-python:cpu
ARG MODEL_IMAGE=dejavu-base-model:cpu

FROM ${MODEL_IMAGE} AS model

FROM ${BASE_IMAGE}
# PyPI, or the host's wheels for `make images BASE=local` (see base.Dockerfile).
ARG PIP_NO_INDEX=0
ARG PIP_FIND_LINKS
COPY services/controller /src/services/controller
RUN pip install --no-cache-dir -c /src/requirements/constraints.txt /src/services/controller
COPY --from=model --chown=10001:10001 /opt/dejavu/model-meta /opt/dejavu/models
ENV DEJAVU_MODEL__CACHE_DIR=/opt/dejavu/models \
    DEJAVU_CONTROLLER__HOST=0.0.0.0 \
    DEJAVU_CONTROLLER__PORT=8000 \
    DEJAVU_CONTROLLER__PROBE_PORT=8001
WORKDIR /home/dejavu
USER 10001:10001
EXPOSE 8000 8001
# /health answers without an API key, on the probe listener (which the API port's load cannot starve);
# any non-2xx answer or no answer fails the check.
# A 10 s timeout: a Python start on a loaded host can take more than 5 s.
HEALTHCHECK --interval=10s --timeout=10s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; e = os.environ; u.urlopen('http://127.0.0.1:%s/health' % (e.get('DEJAVU_CONTROLLER__PROBE_PORT') or e.get('DEJAVU_CONTROLLER__PORT', '8000')), timeout=4)"]
CMD ["dejavu-controller"]
