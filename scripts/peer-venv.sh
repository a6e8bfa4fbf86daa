#!/usr/bin/env bash
# Creates (once) and prints the path of a peer framework's own virtual environment:
#     bash scripts/peer-venv.sh verl     (or areal)
# verl and AReaL pin torch and transformers ranges that conflict with the server's, so each gets a
# venv of its own, built from scripts/peers/<name>.txt and cached outside the clone like ours
# (scripts/bootstrap.sh), keyed by a hash of that file and this script: a fresh machine pays the
# install once, a warm one nothing. `NODEPS pkg==x` lines are installed without their
# dependencies (the file says why). The client (clients/april_client/, never the server) is
# installed into it whenever its source changed (with httpx and msgspec, nothing else): the peer tests drive an
# april-server started from the server's venv (APRIL_SERVER_PYTHON) from this one.
set -euo pipefail
NAME=${1:?usage: peer-venv.sh verl|areal}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PINS="$ROOT/scripts/peers/$NAME.txt"
[ -f "$PINS" ] || { echo "peer-venv: no $PINS" >&2; exit 2; }
PY=${APRIL_PYTHON:-python3}
KEY=$(cat "$PINS" "$ROOT/scripts/peer-venv.sh" | sha256sum | cut -c1-12)
VENV=${APRIL_CACHE:-$HOME/.cache/april-server}/peer-$NAME-$KEY
if [ ! -f "$VENV/.complete" ]; then
  echo "peer-venv: building $VENV (first run only; several minutes)" >&2
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  PIP="$VENV/bin/pip --disable-pip-version-check -q"
  $PIP install -U pip "setuptools>=68" wheel >&2
  # In file order, one line at a time: torch (the CPU build) first, so that later lines find it.
  grep -v '^\s*#' "$PINS" | grep -v '^\s*$' | while read -r first rest; do
    if [ "$first" = NODEPS ]; then
      $PIP install --no-deps $rest >&2
    else
      # shellcheck disable=SC2086
      $PIP install "$first" $rest >&2
    fi
  done
  touch "$VENV/.complete"
fi
# The client, re-installed when it changed, with its own two dependencies (httpx, msgspec).
CLIENT="$ROOT/clients/april_client"
STAMP="$VENV/.client-$(cat "$CLIENT"/*.py "$CLIENT/pyproject.toml" | sha256sum | cut -c1-12)"
if [ ! -f "$STAMP" ]; then
  # Built from a copy: a build in place leaves build/ and *.egg-info in the clone.
  TMP=$(mktemp -d)
  trap 'rm -rf "$TMP"' EXIT
  cp -r "$CLIENT" "$TMP/april_client"
  rm -rf "$TMP/april_client/build" "$TMP/april_client/"*.egg-info "$TMP/april_client/__pycache__"
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-build-isolation \
    --force-reinstall --no-deps "$TMP/april_client" >&2
  "$VENV/bin/pip" install -q --disable-pip-version-check httpx msgspec >&2
  rm -f "$VENV"/.client-* && touch "$STAMP"
fi
echo "$VENV"
