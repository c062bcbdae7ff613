#!/usr/bin/env bash
# Installs what running stream-rl's compose project needs on a Debian machine (ours: root, Debian's
# packages and the Go module proxy reachable, no image registry). Idempotent: a repeat run only
# checks. `make test` runs it before the `docker` tests.
#
# - Debian's docker.io (dockerd 20.10, containerd, runc; the docker CLI if none is on PATH) and
#   debootstrap (for deploy/docker/base.sh). Their services are not started (we run our own
#   engine: deploy/docker/engine.sh).
# - Docker Compose v2 ($COMPOSE_VERSION), built from its Go module once (about 5-10 minutes on 2
#   cores) into $CACHE/tools/docker-compose-$COMPOSE_VERSION; engine.sh makes it the
#   `docker compose` plugin of its own DOCKER_CONFIG. Debian's docker-compose is v1 (1.29): not the
#   `docker compose` users type.
set -euo pipefail

CACHE=${STREAM_RL_CACHE:-$HOME/.cache/stream-rl}
COMPOSE_VERSION=v2.40.3
COMPOSE=$CACHE/tools/docker-compose-$COMPOSE_VERSION

log() { echo "install.sh: $*" >&2; }
die() { echo "install.sh: error: $*" >&2; exit 1; }

packages=()
command -v dockerd >/dev/null || packages+=(docker.io)
command -v debootstrap >/dev/null || packages+=(debootstrap)
if [ ${#packages[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || die "need root to install ${packages[*]} (or install them yourself)"
  log "installing ${packages[*]} from Debian ..."
  # Keep the package scripts from starting Docker's system service (no policy file: add one).
  policy=/usr/sbin/policy-rc.d
  added=
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && added=1
  fi
  trap '[ -z "$added" ] || rm -f "$policy"' EXIT
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
  [ -z "$added" ] || rm -f "$policy"
  trap - EXIT
fi
command -v docker >/dev/null || die "no docker CLI on PATH after installing docker.io"

if [ ! -x "$COMPOSE" ]; then
  command -v go >/dev/null || die "Go (1.24+) is needed to build Docker Compose $COMPOSE_VERSION"
  log "building Docker Compose $COMPOSE_VERSION from its Go module (once) ..."
  start=$SECONDS
  # Built inside its own module: `go install module@version` refuses a go.mod with exclude lines.
  src=$(go mod download -json "github.com/docker/compose/v2@$COMPOSE_VERSION" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
  [ -d "$src" ] || die "the Go module proxy did not give github.com/docker/compose/v2@$COMPOSE_VERSION"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  cp -r "$src" "$work/compose" && chmod -R u+w "$work/compose"
  (cd "$work/compose" && go build -trimpath \
    -ldflags "-s -w -X github.com/docker/compose/v2/internal.Version=$COMPOSE_VERSION" \
    -o "$work/docker-compose" ./cmd)
  mkdir -p "$(dirname "$COMPOSE")"
  mv "$work/docker-compose" "$COMPOSE"
  log "Docker Compose $COMPOSE_VERSION built in $((SECONDS - start)) s: $COMPOSE"
fi
log "ready: $(dockerd --version), $(debootstrap --version), Compose $("$COMPOSE" version --short)"
