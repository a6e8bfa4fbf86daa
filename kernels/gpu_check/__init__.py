"""`make gpu-check`'s harness (scripts/gpu-check.sh runs `python -m kernels.gpu_check`):
on one CUDA device, kernel parity, KV GB/s, resume times and april-bench, each part with its own
timeout, into one JSON + Markdown report; `--dry-run` runs what a CPU can. The ahead-of-time
compile check of the KV kernels (`aot_*.py`) lives here too.

It lives beside the other benchmarks that launch servers, not in `kernels/`: it imports the
server and the client (to start april-server and run april-bench), and `kernels/` is the bottom
layer, which imports neither (tests/unit/test_layers.py).
"""
