# The manual (docs/, mkdocs.yml), built once into the directory the service serves at /manual/.
FROM python:3.11-slim AS manual
WORKDIR /src
RUN pip install --no-cache-dir "mkdocs-material>=9.5,<10"
COPY mkdocs.yml ./
COPY docs ./docs
RUN NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet -d /manual

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
# Where the service looks for the manual by default (VRAMCAST_MANUAL_DIR overrides).
COPY --from=manual /manual ./service/web/manual
ENV VRAMCAST_HOST=0.0.0.0 \
    VRAMCAST_PORT=8000
EXPOSE 8000
CMD ["vramcast", "serve"]
