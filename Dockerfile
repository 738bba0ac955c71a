# One image for every rlmq service of compose.yaml: worker, producer, the scripted model,
# and rq-dashboard (the `dashboard` extra: rq-dashboard plus `six`, which 0.9.0 imports
# without declaring it).
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY common ./common
COPY producer ./producer
COPY workers ./workers
COPY rlmq ./rlmq
RUN pip install '.[dashboard]' && rlmq --help >/dev/null && python -c "import rq_dashboard.cli, prometheus_client"
# scripted model, rq-dashboard, producer metrics
EXPOSE 8000 9181 9101
CMD ["rlmq", "--help"]
