"""The kernel parts of `make gpu-check` (parity, KV GB/s: `parts.py`), the ahead-of-time
compile check of the KV kernels (`aot_*.py`) and the run context they share (`run.py`). Like
the rest of `kernels/`, nothing here imports the server, the client or the bench; the harness
that starts april-server, runs april-bench and writes the report is `april_bench.gpu_check`
(scripts/gpu-check.sh runs it).
"""
