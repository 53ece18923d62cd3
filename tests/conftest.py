import pytest
import torch

from transformer_linear import _C

HAS_CUDA_KERNELS = torch.cuda.is_available() and _C.built_with_cuda()

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not HAS_CUDA_KERNELS, reason="needs a CUDA GPU and a CUDA build"),
        ],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """Every kernel test runs on each device this machine has."""
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
