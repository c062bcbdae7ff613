# The Kafka broker (KRaft, one combined broker and controller) from the jars Maven fetches with
# deploy/kafka/pom.xml: the same broker `stream-rl kafka up` runs without Docker. Configured from
# KAFKA_* variables by the apache/kafka image's rule (deploy/docker/kafka-run.sh). Build context:
# deploy/.
#   docker build -f deploy/docker/kafka.Dockerfile -t stream-rl-kafka deploy
# BASE is any Debian-like image: Java 17 and Maven come from Debian unless BASE has Java and
# deploy/docker/kafka-libs/ holds the jars (deploy/docker/base.sh puts them there), so that the
# build needs no network.
ARG BASE=debian:bookworm-slim
FROM ${BASE}
COPY kafka/pom.xml /opt/kafka/pom.xml
COPY docker/kafka-libs/ /opt/kafka/libs/
RUN set -e; \
    have_jars() { ls /opt/kafka/libs/kafka_2.13-*.jar >/dev/null 2>&1; }; \
    need=""; command -v java >/dev/null || need="openjdk-17-jre-headless"; have_jars || need="$need maven"; \
    if [ -n "$need" ]; then apt-get update && apt-get install -y --no-install-recommends $need; fi; \
    if ! have_jars; then \
      mvn -B -q -f /opt/kafka/pom.xml dependency:copy-dependencies -DoutputDirectory=/opt/kafka/libs \
        -DincludeScope=runtime && rm -rf /root/.m2 && apt-get purge -y --auto-remove maven; \
    fi; \
    rm -rf /var/lib/apt/lists/*; have_jars
COPY docker/kafka-log4j2.properties /opt/kafka/config/log4j2.properties
COPY docker/kafka-run.sh /opt/kafka/bin/run
ENTRYPOINT ["/opt/kafka/bin/run"]
