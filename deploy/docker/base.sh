#!/usr/bin/env bash
# Base images for building stream-rl's images where no image registry can be reached but Debian's
# packages and PyPI can (our development and CI machines). Run from the repository root, with
# DOCKER_HOST pointing at an engine (deploy/docker/engine.sh up) and `make setup` done:
#
#   deploy/docker/base.sh > .env        # then: docker compose up
#
# 1. A Debian bookworm root file system made with debootstrap, holding Python 3.11 (+ venv),
#    OpenJDK 17 and Prometheus from Debian; cached as a tarball in $CACHE/docker/base/ (so that an
#    engine whose data root was lost imports it again instead of running debootstrap) and imported
#    as stream-rl-base:<key> (the Kafka and Prometheus images' base).
# 2. stream-rl-python:<key>: that base plus /opt/venv holding the project's dependencies, installed
#    offline from the uv cache at the versions .venv holds (so the image runs what the tests ran),
#    and pip told to stay offline (PIP_NO_INDEX, PIP_FIND_LINKS=/opt/wheels with setuptools for
#    the editable install). deploy/Dockerfile's pip lines then only install the project.
# 3. The Kafka broker's jars (`stream-rl kafka fetch`, Maven) copied into deploy/docker/kafka-libs/,
#    from where the Kafka image takes them instead of running Maven itself.
#
# Prints the build arguments docker-compose.yml reads, as KEY=VALUE lines (the .env format); all
# progress goes to stderr. Each step is skipped when its result exists (keys are hashes of what
# goes in), so a repeat run takes seconds; stale tarballs and images of older keys are removed.
set -euo pipefail

cd "$(dirname "$0")/../.."
CACHE=${STREAM_RL_CACHE:-$HOME/.cache/stream-rl}
BASE_DIR=$CACHE/docker/base
SUITE=bookworm
# What the base holds; changing the list (or RECIPE) makes a new key, hence a new base.
PACKAGES=python3,python3-venv,openjdk-17-jre-headless,prometheus,ca-certificates
RECIPE=1
UV=${UV:-$(command -v uv || echo "$CACHE/tools/bin/uv")}
VENV_PY=.venv/bin/python

log() { echo "base.sh: $*" >&2; }
die() { echo "base.sh: error: $*" >&2; exit 1; }
key_of() { sha256sum | cut -c1-12; }

docker info >/dev/null 2>&1 || die "no Docker engine answers (DOCKER_HOST=${DOCKER_HOST:-unset}); start one with deploy/docker/engine.sh up"
[ -x "$UV" ] || die "uv not found (run \`make setup\` first)"
[ -x "$VENV_PY" ] || die "$VENV_PY not found (run \`make setup\` first)"
mkdir -p "$BASE_DIR"

# --- 1. the Debian root file system and stream-rl-base -------------------------------------------
base_key=$(printf '%s %s %s\n' "$SUITE" "$PACKAGES" "$RECIPE" | key_of)
base_tar=$BASE_DIR/$SUITE-$base_key.tar
base_image=stream-rl-base:$SUITE-$base_key
if ! docker image inspect "$base_image" >/dev/null 2>&1 && [ ! -f "$base_tar" ]; then
  command -v debootstrap >/dev/null || die "debootstrap not found (deploy/docker/install.sh installs it)"
  [ "$(id -u)" = 0 ] || die "debootstrap needs root"
  root=$(mktemp -d "$BASE_DIR/rootfs.XXXXXX")
  trap 'rm -rf "$root" "$base_tar.tmp"' EXIT
  log "debootstrap $SUITE with $PACKAGES (once; a few minutes) ..."
  start=$SECONDS
  debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" ${DEBIAN_MIRROR:-} >"$BASE_DIR/debootstrap.log" 2>&1 ||
    die "debootstrap failed; see $BASE_DIR/debootstrap.log"
  # Downloaded .debs and package lists are not needed in an image.
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/tmp/*
  tar --numeric-owner -C "$root" -cf "$base_tar.tmp" .
  mv "$base_tar.tmp" "$base_tar"
  rm -rf "$root"
  trap - EXIT
  log "root file system made in $((SECONDS - start)) s: $base_tar ($(du -h "$base_tar" | cut -f1))"
fi
for old in "$BASE_DIR"/"$SUITE"-*.tar; do
  [ ! -f "$old" ] || [ "$old" = "$base_tar" ] || { log "removing stale $old"; rm -f "$old"; }
done
if ! docker image inspect "$base_image" >/dev/null 2>&1; then
  log "importing $base_image ..."
  docker import --change 'CMD ["bash"]' --change 'ENV LANG=C.UTF-8' "$base_tar" "$base_image" >/dev/null
fi

# --- 2. stream-rl-python: the base plus the dependencies in /opt/venv -----------------------------
reqs=$BASE_DIR/requirements.txt
# The runtime dependencies of pyproject.toml, pinned to what .venv holds (so they are in the uv cache).
"$UV" pip freeze --python "$VENV_PY" --exclude-editable >"$reqs.constraints"
"$UV" pip compile pyproject.toml --python-version 3.11 \
  -c "$reqs.constraints" --no-header --no-annotate --quiet -o "$reqs.tmp"
mv "$reqs.tmp" "$reqs"
wheels=$BASE_DIR/wheels
if ! ls "$wheels"/setuptools-*.whl >/dev/null 2>&1; then
  # The build backend of `pip install -e .` (pip installs it into an isolated build environment).
  log "fetching a setuptools wheel for offline editable installs ..."
  [ -x "$BASE_DIR/pip/bin/pip" ] || python3 -m venv "$BASE_DIR/pip"
  "$BASE_DIR/pip/bin/pip" download -q --no-deps -d "$wheels.tmp" "setuptools>=69"
  rm -rf "$wheels" && mv "$wheels.tmp" "$wheels"
fi
py_key=$( { echo "$base_key"; cat "$reqs"; ls "$wheels"; } | key_of)
py_image=stream-rl-python:$py_key
if ! docker image inspect "$py_image" >/dev/null 2>&1; then
  log "installing the dependencies into $py_image (from the uv cache, offline) ..."
  start=$SECONDS
  uv_cache=$("$UV" cache dir)
  name=stream-rl-python-build-$$
  trap 'docker rm -f "$name" >/dev/null 2>&1 || true' EXIT
  docker run --name "$name" --network none \
    -v "$uv_cache:/uv-cache" -v "$(readlink -f "$UV"):/usr/local/bin/uv:ro" \
    -v "$reqs:/tmp/requirements.txt:ro" -v "$wheels:/tmp/wheels:ro" \
    -e UV_CACHE_DIR=/uv-cache -e UV_LINK_MODE=copy "$base_image" \
    sh -ec 'python3 -m venv /opt/venv
            uv pip install --offline --quiet --python /opt/venv/bin/python -r /tmp/requirements.txt
            mkdir -p /opt/wheels && cp /tmp/wheels/*.whl /opt/wheels/' >&2 ||
    die "installing the dependencies failed (is the uv cache complete? run \`make setup\`)"
  docker commit \
    --change 'ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV PIP_NO_INDEX=1 PIP_FIND_LINKS=/opt/wheels' \
    "$name" "$py_image" >/dev/null
  docker rm "$name" >/dev/null
  trap - EXIT
  log "$py_image made in $((SECONDS - start)) s"
fi
# Older keys' images: untag them (their layers go once nothing uses them).
for repo in stream-rl-base stream-rl-python; do
  docker image ls --format '{{.Repository}}:{{.Tag}}' "$repo" | while read -r ref; do
    case "$ref" in "$base_image" | "$py_image") ;; *) log "removing stale $ref"; docker rmi "$ref" >/dev/null || true ;; esac
  done
done

# --- 3. the Kafka broker's jars for the Kafka image -----------------------------------------------
libs=$("$VENV_PY" -c 'from stream_rl.kafka.broker import fetch_jars; print(fetch_jars(quiet=True))')
dest=deploy/docker/kafka-libs
if ! diff -q <(ls "$libs" | grep '\.jar$') <(ls "$dest" 2>/dev/null | grep '\.jar$') >/dev/null; then
  log "copying the Kafka jars into $dest ..."
  find "$dest" -name '*.jar' -delete 2>/dev/null || true
  mkdir -p "$dest" && cp "$libs"/*.jar "$dest"/
fi

echo "STREAM_RL_BASE=$base_image"
echo "STREAM_RL_PYTHON_BASE=$py_image"
