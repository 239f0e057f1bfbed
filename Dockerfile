# The vramcast service image: the API without the optional tracer extra.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY service ./service
COPY migrations ./migrations
COPY clients/python ./clients/python
# Editable, so `vramcast db upgrade` finds migrations/ beside the package; the CLI's client
# distribution from the same tree.
RUN pip install --no-cache-dir ./clients/python -e .
ENV VRAMCAST_HOST=0.0.0.0 \
    VRAMCAST_PORT=8000
EXPOSE 8000
CMD ["vramcast", "serve"]
