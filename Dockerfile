# Recap in a container: the README's install step (a venv, `pip install .`), run as a non-root
# user. The default summarizer prompts are inside the package; the config may live anywhere.
FROM python:3.11-slim

WORKDIR /app
COPY pyproject.toml README.md /src/
COPY proxy /src/proxy
COPY scenes /src/scenes
RUN python3 -m venv /opt/recap && /opt/recap/bin/pip install --no-cache-dir /src \
    && rm -rf /src \
    && useradd --create-home --uid 10001 recap \
    && mkdir -p /app/data && chown recap /app/data
COPY config.yaml /app/config.yaml

USER recap
ENV PATH=/opt/recap/bin:$PATH
# Mount your own config over /app/config.yaml (or set RECAP_CONFIG), and a volume on /app/data.
ENV RECAP_CONFIG=/app/config.yaml
EXPOSE 8080
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s \
  CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status == 200 else 1)"
CMD ["recap", "serve", "--host", "0.0.0.0", "--port", "8080", "--log-format", "json"]
