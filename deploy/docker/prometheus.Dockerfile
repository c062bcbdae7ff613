# Prometheus from Debian's package, configured for docker compose (deploy/prometheus-docker.yml,
# mounted by docker-compose.yml). Build context: deploy/.
#   docker build -f deploy/docker/prometheus.Dockerfile -t stream-rl-prometheus deploy
# BASE is any Debian-like image; the package is installed unless BASE has it (the base
# deploy/docker/base.sh makes does), so that the build needs no network.
ARG BASE=debian:bookworm-slim
FROM ${BASE}
RUN command -v prometheus >/dev/null || { apt-get update && \
      apt-get install -y --no-install-recommends prometheus && rm -rf /var/lib/apt/lists/*; }; \
    mkdir -p /prometheus && chown nobody /prometheus
COPY prometheus-docker.yml /etc/prometheus/prometheus.yml
USER nobody
EXPOSE 9090
ENTRYPOINT ["prometheus", "--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus", \
            "--web.listen-address=:9090"]
