# One image for every service: web, worker and agents (docker-compose.yml).
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu \
    DYNAPLANE_VAR_DIR=/var/lib/dynaplane DJANGO_STATIC_ROOT=/srv/static
WORKDIR /srv/dynaplane
COPY requirements.lock pyproject.toml README.md ./
RUN pip install -r requirements.lock
COPY . .
RUN pip install --no-deps --no-build-isolation -e . \
 && DJANGO_SECRET_KEY=build python -m django collectstatic --noinput --settings controlplane.settings
EXPOSE 8000
CMD ["python", "-m", "daphne", "-b", "0.0.0.0", "-p", "8000", "controlplane.asgi:application"]
