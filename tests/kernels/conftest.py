"""Kernel tests run on CPU through Triton's interpreter; it must be on before kernels import."""

import os

# NOTE: must precede the first `import triton`/kernel import; the root conftest does the same
# when CUDA is absent, this keeps `pytest tests/kernels` working on its own.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed_torch() -> None:
    torch.manual_seed(0)
