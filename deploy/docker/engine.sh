#!/usr/bin/env bash
# A Docker engine of stream-rl's own (Debian's docker.io dockerd), for a machine where no engine
# runs, such as our development and CI machines (deploy/docker/install.sh installs it):
#
#   eval "$(deploy/docker/engine.sh up)"   start it (or find it running); prints the exports to use
#                                          it: DOCKER_HOST, DOCKER_CONFIG (Compose v2), DOCKER_BUILDKIT
#   deploy/docker/engine.sh env            the same exports, for an engine that runs
#   deploy/docker/engine.sh down           stop it by its pid, then remove what it left behind
#
# How it runs, and why:
# - data root $CACHE/docker/data: image layers, the build cache and volumes persist between runs
#   (a repeat build takes seconds). One engine at a time uses it: `up` waits (up to
#   $STREAM_RL_DOCKER_WAIT s) while another stream-rl engine holds it, and takes over the data root
#   of one whose owner died.
# - exec root, socket, pidfile and log in $STREAM_RL_DOCKER_RUN (default /run/stream-rl-docker):
#   runtime state only. Several engines with different run dirs can exist; each passes its own.
# - no default bridge, no iptables or ip6tables rules, no ip_forward or masquerading: the
#   containers of a compose project reach each other on the project's own network, whose subnet
#   comes from $STREAM_RL_DOCKER_POOL, and nothing else (no NAT: no way out); published ports
#   work through docker-proxy on 127.0.0.1. Builds get no network either (what they need is in
#   the base images, deploy/docker/base.sh).
# - containers in a cgroup of their own (/stream-rl-docker-<hash of the run dir>), so that `down`
#   can find any that outlive dockerd.
# `down` removes the bridges of the engine's networks and its mounts even after a crash; it
# changes nothing else on the host, because nothing else was changed.
set -euo pipefail

CACHE=${STREAM_RL_CACHE:-$HOME/.cache/stream-rl}
STATE=$CACHE/docker
DATA=$STATE/data
RUN=${STREAM_RL_DOCKER_RUN:-/run/stream-rl-docker}
POOL=${STREAM_RL_DOCKER_POOL:-10.213.0.0/16}
WAIT=${STREAM_RL_DOCKER_WAIT:-900}
SOCK=$RUN/docker.sock
PIDFILE=$RUN/dockerd.pid
OWNER=$STATE/data.owner # "<dockerd pid> <run dir>" of the engine using $DATA
COMPOSE_VERSION=v2.40.3

log() { echo "engine.sh: $*" >&2; }
die() { echo "engine.sh: error: $*" >&2; exit 1; }

alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null && [ "$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null)" != Z ]; }
pid_of() { [ -f "$1" ] && cat "$1" || true; }
# A dockerd process started with our run dir (so never someone else's daemon).
ours() { alive "$1" && tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -q -- "--exec-root $2/exec "; }

exports() {
  echo "export DOCKER_HOST=unix://$SOCK"
  echo "export DOCKER_CONFIG=$STATE/config"
  # The classic builder: dockerd 20.10's BuildKit needs the default bridge for RUN steps.
  echo "export DOCKER_BUILDKIT=0"
}

compose_plugin() {
  # Compose v2 as a CLI plugin in our own DOCKER_CONFIG (the user's ~/.docker is left alone).
  local bin=$CACHE/tools/docker-compose-$COMPOSE_VERSION
  [ -x "$bin" ] || { log "warning: Compose $COMPOSE_VERSION is not built yet (deploy/docker/install.sh builds it)"; return; }
  mkdir -p "$STATE/config/cli-plugins"
  ln -sfn "$bin" "$STATE/config/cli-plugins/docker-compose"
}

# Containers go in a cgroup named after the run dir, so `down` finds any that outlive dockerd.
cgroup_of() { echo "stream-rl-docker-$(echo "$1" | sha1sum | cut -c1-8)"; }

answers() { DOCKER_HOST=unix://$SOCK docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

# Remove what a dead engine left: processes in our cgroup, netns mounts, bridges of its networks.
cleanup_after() {
  local run=$1 cg pid id cgroup
  cgroup=$(cgroup_of "$run")
  for cg in /sys/fs/cgroup/*/"$cgroup"; do
    [ -d "$cg" ] || continue
    for pid in $(cat "$cg"/*/cgroup.procs 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
  done
  sleep 0.5
  for cg in /sys/fs/cgroup/*/"$cgroup"; do
    [ -d "$cg" ] || continue
    find "$cg" -mindepth 1 -depth -type d -exec rmdir {} + 2>/dev/null || true
    rmdir "$cg" 2>/dev/null || true
  done
  # Mounts under our exec root and data root, deepest first.
  awk -v a="$run/" -v b="$DATA/" 'index($5, a) == 1 || index($5, b) == 1 {print $5}' /proc/self/mountinfo | sort -r |
    while read -r m; do umount -l "$m" 2>/dev/null || true; done
  if [ -f "$run/networks" ]; then
    while read -r id; do
      ip link show "br-${id:0:12}" >/dev/null 2>&1 && ip link delete "br-${id:0:12}" && log "removed bridge br-${id:0:12}"
    done <"$run/networks"
    rm -f "$run/networks"
  fi
}

# Stop the dockerd of run dir $1 (pid $2): SIGTERM (it stops its containers and containerd), then
# SIGKILL of it and its containerd after 60 s.
stop_engine() {
  local run=$1 pid=$2 ctr i
  ctr=$(pid_of "$run/exec/containerd/containerd.pid")
  kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 600); do alive "$pid" || break; sleep 0.1; done
  if alive "$pid"; then
    log "dockerd (pid $pid) did not stop within 60 s of SIGTERM; killing it"
    kill -9 "$pid" 2>/dev/null || true
  fi
  for i in $(seq 100); do alive "$ctr" || break; sleep 0.1; done
  alive "$ctr" && kill -9 "$ctr" 2>/dev/null || true
  cleanup_after "$run"
  rm -f "$run/dockerd.pid" "$SOCK"
}

record_networks() {
  # The bridges `down` must remove if dockerd dies without removing them.
  DOCKER_HOST=unix://$SOCK docker network ls -q --no-trunc --filter driver=bridge >"$RUN/networks" 2>/dev/null || true
}

# Start dockerd in the background; print its pid once it answers (fail if it exits or stays silent).
start_dockerd() {
  local pid
  log "starting dockerd (data root $DATA, run dir $RUN, log $RUN/dockerd.log)"
  # 9>&-: the lock stays with this script, not with dockerd and its children.
  setsid dockerd \
    --data-root "$DATA" --exec-root "$RUN/exec" -H "unix://$SOCK" --pidfile "$PIDFILE" \
    --bridge none --iptables=false --ip6tables=false --ip-forward=false --ip-masq=false \
    --default-address-pool "base=$POOL,size=24" --cgroup-parent "/$(cgroup_of "$RUN")" \
    --storage-driver overlay2 --log-level warn --config-file "$RUN/daemon.json" \
    </dev/null >"$RUN/dockerd.log" 2>&1 9>&- &
  pid=$!
  for _ in $(seq 600); do
    if answers; then echo "$pid"; return 0; fi
    alive "$pid" || return 1
    sleep 0.1
  done
  stop_engine "$RUN" "$pid"
  return 1
}

up() {
  command -v dockerd >/dev/null || die "dockerd not found (deploy/docker/install.sh installs Debian's docker.io)"
  mkdir -p "$STATE" "$RUN"
  compose_plugin
  local pid deadline=$((SECONDS + WAIT)) owner_pid owner_run
  exec 9>"$STATE/engine.lock"
  while :; do
    flock -w "$WAIT" 9 || die "could not lock $STATE/engine.lock within $WAIT s"
    pid=$(pid_of "$PIDFILE")
    if ours "$pid" "$RUN" && answers; then
      flock -u 9
      log "dockerd already running (pid $pid)"
      exports
      return
    fi
    owner_pid= owner_run=
    [ -f "$OWNER" ] && read -r owner_pid owner_run <"$OWNER"
    if [ -n "$owner_pid" ] && ours "$owner_pid" "$owner_run"; then
      flock -u 9
      [ "$SECONDS" -lt "$deadline" ] || die "$DATA is used by another stream-rl engine (dockerd pid $owner_pid, $owner_run) for over $WAIT s; stop it with STREAM_RL_DOCKER_RUN=$owner_run $0 down"
      log "waiting for the engine using $DATA (dockerd pid $owner_pid) to stop ..."
      sleep 5
      continue
    fi
    break
  done
  # Whatever a dead engine of ours left (ours or the data root's last owner).
  [ -n "$owner_pid" ] && [ -d "${owner_run:-}" ] && cleanup_after "$owner_run"
  cleanup_after "$RUN"
  rm -f "$PIDFILE" "$SOCK"
  mkdir -p "$DATA" "$RUN/exec"
  # Its identity key in our state dir, not in /etc/docker (there is no command line flag for it).
  printf '{"deprecated-key-path": "%s"}\n' "$STATE/key.json" >"$RUN/daemon.json"
  if ! pid=$(start_dockerd); then
    # A data root a crash left unusable is only a cache: start over with an empty one, once.
    log "dockerd failed to start on $DATA; last lines of its log:"
    tail -n 5 "$RUN/dockerd.log" >&2
    log "moving the data root aside and starting on an empty one (a cold cache)"
    cleanup_after "$RUN"
    mv "$DATA" "$DATA.broken.$$" && rm -rf "$DATA.broken.$$" && mkdir -p "$DATA"
    pid=$(start_dockerd) || { flock -u 9; die "dockerd failed to start; see $RUN/dockerd.log:
$(tail -n 15 "$RUN/dockerd.log")"; }
  fi
  echo "$pid $RUN" >"$OWNER"
  flock -u 9
  log "dockerd up (pid $pid, $(DOCKER_HOST=unix://$SOCK docker version --format '{{.Server.Version}}'))"
  exports
}

down() {
  local pid
  pid=$(pid_of "$PIDFILE")
  if ours "$pid" "$RUN"; then
    record_networks
    stop_engine "$RUN" "$pid"
    log "dockerd (pid $pid) stopped"
  else
    cleanup_after "$RUN"
    log "no engine of ours runs from $RUN"
  fi
  # Runtime state only; its log goes beside the data root, for a look after the fact.
  [ ! -f "$RUN/dockerd.log" ] || mv "$RUN/dockerd.log" "$STATE/dockerd-last.log"
  if awk -v a="$RUN/" 'index($5, a) == 1 {found=1} END {exit !found}' /proc/self/mountinfo; then
    log "warning: mounts remain under $RUN; leaving it"
  else
    rm -rf "$RUN"
  fi
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  env) ours "$(pid_of "$PIDFILE")" "$RUN" || die "no engine of ours runs from $RUN (run: $0 up)"; exports ;;
  record-networks) record_networks ;;
  *) die "usage: $0 up|env|down" ;;
esac
