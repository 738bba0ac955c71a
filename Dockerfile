FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY common ./common
COPY producer ./producer
COPY workers ./workers
RUN pip install --no-cache-dir '.[dashboard]'
