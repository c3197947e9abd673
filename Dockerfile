# celery-ledger project image: the worker, beat, Flower and CLI processes of docker-compose.yml.
#
#   docker build -t celery-ledger .
#   docker run --rm celery-ledger celery-ledger --help
#
# Your own project's image installs celery-ledger next to your tasks the same way and runs
# `celery -A yourproject ...`; compose takes the app module from CELERY_APP.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A fixed unprivileged user: Celery warns (and refuses pickle) as root, and nothing here needs
# root after the install.
RUN useradd --create-home --uid 10001 ledger

WORKDIR /app

# Metadata first, so that a code change does not re-resolve the dependencies' layer.
COPY pyproject.toml README.md ./
COPY ledger ./ledger
COPY recovery ./recovery
COPY worker ./worker
RUN pip install . \
    && mkdir -p /var/lib/celery-ledger \
    && chown ledger:ledger /var/lib/celery-ledger

USER ledger
# Beat's schedule file and the embedded default's files, if a container runs without servers.
ENV CELERY_LEDGER_DATA_DIR=/var/lib/celery-ledger

CMD ["celery-ledger", "--help"]
