#!/usr/bin/env bash
# The base images the tests' Dockerfiles name, made here from Debian's packages: no container registry is
# reachable on these machines, so `FROM python:3.11-slim` can only mean a local image of that name.
#   python:3.11-slim        Debian bookworm (minbase) with python3 (3.11), python, bash, coreutils
#   harness-test/bare:12    the same without Python: an image holding neither Python nor Node
#   harness-test/git:12     python:3.11-slim's Debian with git, WORKDIR /app (aider finds a task's files through git)
#   harness-test/tmux:12    python:3.11-slim's Debian with tmux, WORKDIR /app (terminus-2 drives a tmux session; the
#                           bugfix tasks' verifiers run python3)
# An image already present under a name (a real one pulled elsewhere) is left as it is.
set -euo pipefail
STAMPS=${1:-.setup-stamps}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
have() { docker image inspect "$1" >/dev/null 2>&1; }
if have python:3.11-slim && have harness-test/bare:12 && have harness-test/git:12 && have harness-test/tmux:12; then
  echo "setup: base images are present"; exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap is missing: apt-get install debootstrap"; exit 1; }
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
started=$SECONDS
echo "setup: base images (debootstrap bookworm, ~1 min each) ..."
bootstrap() {  # packages, folder
  debootstrap --variant=minbase --include="$1" bookworm "$2" "$MIRROR" >"$STAMPS/debootstrap.log" 2>&1 \
    || { tail -n 20 "$STAMPS/debootstrap.log"; exit 1; }
  rm -rf "$2"/var/cache/apt/archives/*.deb "$2"/var/lib/apt/lists/*
}
if ! have python:3.11-slim || ! have harness-test/bare:12; then bootstrap python3,python-is-python3 "$root/base"; fi
if ! have harness-test/git:12; then
  bootstrap python3,python-is-python3,git "$root/git"
  tar -C "$root/git" -c . | docker import -c 'CMD ["bash"]' -c 'ENV LANG=C.UTF-8' -c 'WORKDIR /app' - harness-test/git:12 >/dev/null
fi
if ! have harness-test/tmux:12; then
  bootstrap python3,python-is-python3,tmux "$root/tmux"
  tar -C "$root/tmux" -c . | docker import -c 'CMD ["bash"]' -c 'ENV LANG=C.UTF-8' -c 'WORKDIR /app' - harness-test/tmux:12 >/dev/null
fi
have python:3.11-slim || tar -C "$root/base" -c . | docker import -c 'CMD ["python3"]' -c 'ENV LANG=C.UTF-8' - python:3.11-slim >/dev/null
have harness-test/bare:12 || tar -C "$root/base" --exclude='./usr/lib/python3*' --exclude='./usr/bin/python*' \
  --exclude='./usr/lib/x86_64-linux-gnu/libpython*' -c . | docker import -c 'CMD ["bash"]' - harness-test/bare:12 >/dev/null
echo "setup: base images made in $((SECONDS - started)) s"
