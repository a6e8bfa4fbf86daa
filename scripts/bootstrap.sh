#!/usr/bin/env bash
# Creates (once) and prints the path of the project's virtual environment.
# The venv lives outside the clone, keyed by a hash of the dependency pins, so CI and later
# sessions reuse it: a fresh machine pays the ~6 GB install once, a warm one pays nothing.
# Light extras (LIGHT below: one wheel each) stay out of the key and are installed with the
# project itself, so adding one does not rebuild the heavy venv.
# The project is three distributions, installed editable without deps (all are above): the
# server (pyproject.toml), the client (clients/april_client/) and april-bench (clients/april_bench/).
# CPU-only x86: SGLang is installed with --no-deps and its CUDA-only dependencies are left out
# (CPU recipe: torch/torchvision at SGLang's pins first, then sglang --no-deps, then the extras listed in pyproject.toml; flashinfer, sgl-kernel and the other CUDA-only packages are left out).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${APRIL_PYTHON:-python3}
KEY=$("$PY" - "$ROOT/pyproject.toml" "$ROOT/clients/april_bench/pyproject.toml" <<'PYEOF'
import hashlib, sys, tomllib
p, b = (tomllib.load(open(f, "rb"))["project"] for f in sys.argv[1:])
heavy = {k: v for k, v in p["optional-dependencies"].items() if k not in ("fleet", "test-parallel")}  # LIGHT
bench = {k: v for k, v in b["optional-dependencies"].items() if k != "workloads"}  # LIGHT
blob = repr((p["dependencies"], heavy, b["dependencies"], bench, "v1")).encode()
print(hashlib.sha256(blob).hexdigest()[:12])
PYEOF
)
VENV=${APRIL_VENV:-${APRIL_CACHE:-$HOME/.cache/april-server}/venv-$KEY}
if [ ! -f "$VENV/.complete" ]; then
  echo "bootstrap: building $VENV (first run only; several minutes)" >&2
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  PIP="$VENV/bin/pip --disable-pip-version-check -q"
  $PIP install -U pip >&2
  extras=$("$PY" - "$ROOT/pyproject.toml" "$ROOT/clients/april_bench/pyproject.toml" <<'PYEOF'
import sys, tomllib
o, b = (tomllib.load(open(f, "rb"))["project"]["optional-dependencies"] for f in sys.argv[1:])
print("\n".join(o["cpu"] + o["dev"] + o["trl"] + b["plots"] + b["progress"]))
PYEOF
)
  # torch/torchvision first, at SGLang's pins (a CUDA build that runs on CPU).
  $PIP install "torch==2.14.1" "torchvision==0.29.1" >&2
  $PIP install --no-deps "sglang==0.5.23" >&2
  # shellcheck disable=SC2086
  echo "$extras" | xargs $PIP install >&2
  touch "$VENV/.complete"
fi
# The project itself: the three distributions, editable, no deps (they are all above). Re-done
# when a pyproject.toml changes (entry points, scripts) or the venv points at another clone.
TOMLS=("$ROOT/pyproject.toml" "$ROOT/clients/april_client/pyproject.toml" "$ROOT/clients/april_bench/pyproject.toml")
STAMP="$VENV/.april-$(cat "${TOMLS[@]}" "$ROOT/scripts/bootstrap.sh" | sha256sum | cut -c1-12)-$(echo "$ROOT" | sha256sum | cut -c1-8)"
if [ ! -f "$STAMP" ]; then
  light=$("$PY" - "$ROOT/pyproject.toml" "$ROOT/clients/april_bench/pyproject.toml" <<'PYEOF'
import sys, tomllib
o, b = (tomllib.load(open(f, "rb"))["project"]["optional-dependencies"] for f in sys.argv[1:])
print("\n".join(o["fleet"] + o["test-parallel"] + b["workloads"]))
PYEOF
)
  # shellcheck disable=SC2086
  echo "$light" | xargs "$VENV/bin/pip" install -q --disable-pip-version-check >&2
  "$VENV/bin/pip" install -q --no-deps --no-build-isolation \
    -e "$ROOT" -e "$ROOT/clients/april_client" -e "$ROOT/clients/april_bench" >&2
  rm -f "$VENV"/.april-* && touch "$STAMP"
fi
echo "$VENV"
