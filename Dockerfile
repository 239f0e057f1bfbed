# The vramcast service image: the API without the optional tracer extra.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY service ./service
COPY migrations ./migrations
# Editable, so `vramcast db upgrade` finds migrations/ beside the package.
RUN pip install --no-cache-dir -e .
ENV VRAMCAST_HOST=0.0.0.0 \
    VRAMCAST_PORT=8000
EXPOSE 8000
CMD ["vramcast", "serve"]
