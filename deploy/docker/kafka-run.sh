#!/bin/sh
# The Kafka image's entry point: server.properties from the KAFKA_* variables (the apache/kafka
# image's rule: drop KAFKA_, then `___` -> `-`, `__` -> `_`, `_` -> `.`, lower case; the JVM
# variables KAFKA_HEAP_OPTS and KAFKA_OPTS are not properties), KRaft storage formatted once with
# $CLUSTER_ID, then the broker in the foreground (SIGTERM stops it cleanly).
# $STREAM_RL_KAFKA_HOME (default /opt/kafka) holds libs/ and config/ (tests/unit/test_deploy.py
# runs this script against a directory of its own).
set -euf # -f: no globbing, so the class path libs/* reaches java as written
home=${STREAM_RL_KAFKA_HOME:-/opt/kafka}
conf=$home/config/server.properties
: >"$conf"
env | sort | while IFS='=' read -r name value; do
  case "$name" in
    KAFKA_HEAP_OPTS | KAFKA_OPTS | KAFKA_JVM_PERFORMANCE_OPTS | KAFKA_LOG4J_OPTS) ;;
    KAFKA_*)
      key=$(printf '%s' "${name#KAFKA_}" | sed 's/___/-/g; s/__/@/g; s/_/./g; s/@/_/g' | tr 'A-Z' 'a-z')
      printf '%s=%s\n' "$key" "$value" >>"$conf"
      ;;
  esac
done
grep -q '^log.dirs=' "$conf" || echo "log.dirs=/var/lib/kafka/data" >>"$conf"
logs=$(sed -n 's/^log.dirs=//p' "$conf" | cut -d, -f1)
java="java ${KAFKA_HEAP_OPTS:--Xmx512m} -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -Djava.awt.headless=true
  -Dlog4j2.configurationFile=$home/config/log4j2.properties -Dstream_rl.started_log=$home/started.log
  ${KAFKA_OPTS:-} -cp $home/libs/*"
# The secured variant (deploy/compose/secure.yml): the operator's SCRAM user, made at format so that
# its first login works (its password from the file the variable names, a Compose secret).
scram=""
if [ -n "${STREAM_RL_KAFKA_OPERATOR_PASSWORD_FILE:-}" ]; then
  scram="--add-scram SCRAM-SHA-512=[name=operator,password=$(cat "$STREAM_RL_KAFKA_OPERATOR_PASSWORD_FILE")]"
fi
if [ ! -f "$logs/meta.properties" ]; then
  : "${CLUSTER_ID:?set CLUSTER_ID (a base64 UUID) to format the KRaft storage}"
  # `=`: an id may start with "-", which the tool's parser would take for an option.
  $java -Xmx256m kafka.tools.StorageTool format --cluster-id="$CLUSTER_ID" -c "$conf" $scram >/dev/null
fi
rm -f "$home/started.log"
exec $java kafka.Kafka "$conf"
