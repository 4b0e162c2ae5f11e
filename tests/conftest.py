"""Shared fixtures.

Triton's interpreter is chosen when a kernel is decorated, so TRITON_INTERPRET must
be set before anything imports triton: here, at conftest import. On a machine with
CUDA it is left alone so that GPU tests run the compiled kernels.
"""

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

# one intra-op thread per xdist worker: the workers already fill the cores, and two workers
# each running torch's default of one thread per core oversubscribe them (a model of many small
# ops, Qwen3-Next's chunked delta rule, ran 15x slower next to another worker)
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

from normfuse.zoo import prepare_torchvision  # noqa: E402

# transformers imports torchvision whenever it is installed; a torchvision wheel whose C
# extension does not load (the CUDA build next to a CPU torch) imports only after this
prepare_torchvision()


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches empty before and after the test (a module opts in with
    ``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def triton_cpu(monkeypatch):
    """Run the fused ops' Triton kernels on CPU tensors, under Triton's interpreter."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels are compiled for the GPU here (TRITON_INTERPRET is not 1)")
    monkeypatch.setenv("NORMFUSE_TRITON_CPU", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
