#!/usr/bin/env bash
# GPU readiness check in one command: kernel parity, KV save/restore GB/s, resume restore vs
# re-prefill on an 8B-shaped model, april-bench sync/static/adaptive. One JSON + one markdown
# table under out/gpu-check/ (clients/april_bench/gpu_check/__main__.py says what each
# part does; the kernel parts are in kernels/gpu_check/).
#
#   scripts/gpu-check.sh --dry-run     # CPU: everything a CPU can check (~2 min here)
#   scripts/gpu-check.sh               # on one CUDA device: all parts, <= 10 min, no network
#
# Python: $APRIL_GPU_PYTHON if set (e.g. python3 in the lmsysorg/sglang:v0.5.23 image, whose
# SGLang has its CUDA stack; msgspec, httpx and prometheus-client must be installed there; the
# server, the client and the bench are taken from this checkout), else the project's venv (scripts/bootstrap.sh: the CPU recipe,
# fine for --dry-run).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
if [ -n "${APRIL_GPU_PYTHON:-}" ]; then
  PY=$APRIL_GPU_PYTHON
else
  PY="$(bash scripts/bootstrap.sh)/bin/python"
fi
# The server and the kernels from the root, the client and april_bench (the harness) from
# clients/ (each folder there is named as it is imported).
export PYTHONPATH="$ROOT:$ROOT/clients${PYTHONPATH:+:$PYTHONPATH}"
missing=$("$PY" - <<'PYEOF'
import importlib.util
need = ["torch", "triton", "sglang", "transformers", "httpx", "msgspec", "prometheus_client",
        "april_client"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
PYEOF
)
if [ -n "$missing" ]; then
  echo "gpu-check: $PY lacks: $missing" >&2
  exit 2
fi
# The interpreter is for CPU-only test runs; a device run must use the real kernels.
unset TRITON_INTERPRET
exec "$PY" -m april_bench.gpu_check "$@"
