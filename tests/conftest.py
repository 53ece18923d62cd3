import pytest
import torch

from cpu_paths import SUPPORTED_ISAS

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


@pytest.fixture(params=SUPPORTED_ISAS)
def gemm_isa(request) -> str:
    """Each CPU path this machine runs, forced for the test (each has its own GEMM packing and micro-kernel:
    avx512_bf16 its vdpbf16ps or AMX one); the measured choice ("auto") is restored after."""
    _C.set_cpu_isa(request.param)
    yield request.param
    _C.set_cpu_isa("auto")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def restore_torch_threads():
    """Tests that set torch's thread count get the previous count back afterwards."""
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


@pytest.fixture
def allclose_on_fp8(monkeypatch):
    """opcheck's test_schema compares every input before and after the call with torch.allclose, which has
    no kernel for 8-bit floats: compare those (FP8 data, E4M3 and E8M0 scales) bit for bit instead."""
    allclose = torch.allclose

    def fp8_aware(a, b, *args, **kwargs):
        if a.dtype.is_floating_point and a.dtype.itemsize == 1:
            return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return allclose(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "allclose", fp8_aware)
