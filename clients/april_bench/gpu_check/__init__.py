"""`make gpu-check`'s harness (scripts/gpu-check.sh runs `python -m april_bench.gpu_check`): on
one CUDA device, kernel parity, KV GB/s, resume times and april-bench, each part with its own
timeout, into one JSON + Markdown report; `--dry-run` runs what a CPU can.

It starts april-server and runs april-bench, so it sits on top of everything
(tests/unit/test_layers.py: `harness`); the kernel parts it runs (parity, GB/s, the
ahead-of-time check) live with the kernels in `kernels/gpu_check/`, which import nothing of
ours.
"""
