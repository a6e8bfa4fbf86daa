"""`make gpu-check`'s harness (scripts/gpu-check.sh runs `python -m kernels.gpu_check`):
on one CUDA device, kernel parity, KV GB/s, resume times and april-bench, each part with its own
timeout, into one JSON + Markdown report; `--dry-run` runs what a CPU can. The ahead-of-time
compile check of the KV kernels (`aot_*.py`) lives here too.

It lives in `kernels/`, beside the kernels it checks, but not in their layer: it imports the
server and the client (to start april-server and run april-bench), so
tests/unit/project/test_layers.py puts `kernels.gpu_check` on top of everything (`harness`),
while the kernels themselves are the bottom layer and import nothing of ours.
"""
