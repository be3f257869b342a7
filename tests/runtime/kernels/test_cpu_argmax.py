"""The extension's greedy token choice returns torch.argmax's index on every path: ties, NaN, infinities,
signed zeros, row lengths around the vector widths, float32 and bfloat16."""

import pytest
import torch

from runtime.kernels import extension
from runtime.kernels.cpu_argmax import ARGMAX_PATHS, argmax

pytestmark = pytest.mark.skipif(not extension.available(), reason="CPU extension not built here")

LENGTHS = [1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 100, 4099]
CASES = ["random", "ties", "all -inf", "nan", "zeros", "inf last"]


def _rows(case: str, n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(3, n, generator=g)
    if case == "ties":
        x = torch.randint(-2, 2, (3, n), generator=g).float()
    elif case == "all -inf":
        x[:] = float("-inf")
    elif case == "nan":
        x[1, n // 2] = float("nan")
        x[2, n - 1] = float("nan")
        x[2, 0] = float("inf")
    elif case == "zeros":
        x = torch.zeros(3, n)
        x[0, n - 1] = -0.0
        x[1, 0] = -0.0
    elif case == "inf last":
        x[:, n - 1] = float("inf")
    return x.to(dtype)


def _paths_here() -> list[str]:
    """The op's paths this CPU runs (a path it lacks is refused)."""
    runs = []
    for name, isa in ARGMAX_PATHS.items():
        try:
            extension.ops().argmax_rows(torch.zeros(1, 1), isa)
        except RuntimeError:
            continue
        runs.append(name)
    return runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_every_path_this_cpu_runs_returns_torch_argmax(dtype, case):
    """Every path the CPU runs (the plain C++ one always, AVX2 too on AVX-512 CPUs) gives torch's index."""
    paths = _paths_here()
    assert "generic" in paths and ("avx512" not in paths or "avx2" in paths)
    g = torch.Generator().manual_seed(len(case))
    for n in LENGTHS:
        x = _rows(case, n, dtype, g)
        for path in paths:
            assert torch.equal(extension.ops().argmax_rows(x, ARGMAX_PATHS[path]), x.argmax(-1)), (path, n)


def test_wrapper_keeps_shapes_and_strides_and_falls_back():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 151936, generator=g).to(torch.bfloat16)
    assert torch.equal(argmax(x), x.argmax(-1))  # (B, T, V) -> (B, T)
    view = x[:, ::2]  # not contiguous
    assert torch.equal(argmax(view), view.argmax(-1))
    half = x.half()  # a dtype the op does not take: torch's own argmax
    assert torch.equal(argmax(half), half.argmax(-1))


def test_op_names_bad_input():
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        extension.ops().argmax_rows(torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="non-empty last dimension"):
        extension.ops().argmax_rows(torch.zeros(2, 0))
    with pytest.raises(RuntimeError, match="isa must be"):
        extension.ops().argmax_rows(torch.zeros(2, 3), 7)
