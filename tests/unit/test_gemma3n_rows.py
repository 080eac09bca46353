"""Gemma 3n's row reductions (model/gemma3n.py row_mean: the gaussian top-k's mean and standard
deviation, AltUp's magnitudes): a row's mean is the same bits alone or among others, in every
dtype, and a 16-bit row's is ATen's float32-accumulated mean rounded once, not the sum of
16-bit partial sums."""

from __future__ import annotations

import pytest
import torch

from conveyor.model.gemma3n import row_mean


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("width", [100, 2048])
def test_a_rows_mean_is_the_same_bits_whatever_rows_come_with_it(dtype, width):
    rows = torch.randn(67, width, generator=torch.Generator().manual_seed(0)).to(dtype)
    together = row_mean(rows)
    alone = torch.cat([row_mean(rows[i : i + 1]) for i in range(rows.shape[0])])
    assert torch.equal(together, alone)
    assert torch.allclose(together.double(), rows.double().mean(-1, keepdim=True), atol=1e-2)


def test_a_bfloat16_rows_mean_is_added_in_float32():
    # 256 then 255 ones: 16-bit partial sums lose ones beside 256 (its spacing is 2)
    rows = torch.ones(1, 256, dtype=torch.bfloat16)
    rows[0, 0] = 256.0
    assert row_mean(rows).dtype == torch.bfloat16
    assert row_mean(rows).item() == rows.mean().item()
