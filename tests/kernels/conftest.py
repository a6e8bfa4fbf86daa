"""Kernel tests: on CPU, Triton must run in its interpreter, switched on before kernels import."""

import os

import pytest
import torch

# NOTE: must precede the first kernel import. The root conftest does the same; repeating it keeps
# `pytest tests/kernels` safe on its own. Not on CUDA machines: there the tests use real kernels,
# and the interpreter would also capture every other Triton kernel in the session.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed_torch() -> None:
    torch.manual_seed(0)
