"""``tutorial_kernels.transpose``: bit-for-bit ``x.t().contiguous()`` for 1-, 2- and 4-byte elements, ragged
tiles (sizes that are not multiples of the block), grids within CUDA's limits for any shape, and clear errors."""

import math

import pytest
import torch
import tutorial_kernels.transpose as transpose_module
from tutorial_kernels.grid_limits import CUDA_MAX_GRID
from tutorial_kernels.transpose import transpose

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # compiled kernels take GPU tensors; the interpreter CPU ones

@pytest.mark.parametrize("shape", [(1, 1), (70, 33), (128, 64), (129, 200)])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
def test_transpose_equals_torch_bit_for_bit(shape, dtype):
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    if dtype != torch.uint8:
        x = torch.randn(shape, generator=g).to(dtype)
    x = x.to(DEV)
    out = transpose(x, block=32)
    assert out.shape == (shape[1], shape[0]) and out.is_contiguous() and out.dtype == dtype
    assert torch.equal(out.view(-1).view(torch.uint8), x.t().contiguous().view(-1).view(torch.uint8))


def test_transpose_errors():
    with pytest.raises(ValueError, match="2-D"):
        transpose(torch.zeros(2, 2, 2))
    with pytest.raises(ValueError, match="contiguous"):
        transpose(torch.zeros(4, 6).t())
    assert transpose(torch.zeros(0, 5)).shape == (5, 0)
    with pytest.raises(TypeError, match="real or bool"):  # Triton has no complex element type
        transpose(torch.zeros(4, 6, dtype=torch.complex64, device=DEV))


@pytest.mark.parametrize("shape", [(1, 65_536 * 128 + 1), (65_536 * 128 + 1, 1), (3, 65_536 * 128 + 128)])
def test_wide_and_tall_inputs_launch_within_cuda_grid_limits(launch_recorder, shape):
    """One program per 128x128 tile, and the tile count on grid axis 0: a (1, 8.4M) tensor has 65,537 column
    tiles, past the 65,535 CUDA allows on axis 1 (the launch would fail on a GPU, never in the interpreter)."""
    recorder = launch_recorder(transpose_module, "_transpose_kernel")
    x = torch.empty(shape, dtype=torch.uint8)
    assert transpose(x).shape == shape[::-1]
    (grid,) = recorder.grids
    assert all(n <= cap for n, cap in zip(grid, CUDA_MAX_GRID, strict=False)), grid
    assert math.prod(grid) == -(-shape[0] // 128) * -(-shape[1] // 128)  # the same number of programs
