"""``--batch-invariant`` for BLAS matmuls: never fewer than ``MIN_MATMUL_ROWS`` rows in a call.

PyTorch's CPU matmul hands small row counts to other BLAS kernels (measured with MKL's AVX2 kernels:
1-3, 5-7 and 9-11 rows each sum differently from the same row among 12 or more), so a token's result
would depend on how many tokens share its step. Padded with zero rows to ``MIN_MATMUL_ROWS``, every
call takes the kernels of larger batches, where a row's sums do not depend on the others
(``tests/engine/test_batch_invariance.py`` checks it on each machine).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MIN_MATMUL_ROWS = 16


def padded_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (m, k), with zero rows appended up to ``MIN_MATMUL_ROWS``."""
    m = rows.shape[0]
    return rows if m >= MIN_MATMUL_ROWS else torch.cat([rows, rows.new_zeros(MIN_MATMUL_ROWS - m, rows.shape[1])])


class RowPaddedLinear(nn.Linear):
    """``nn.Linear`` whose matmul never gets fewer than ``MIN_MATMUL_ROWS`` rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        m = rows.shape[0]
        if m >= MIN_MATMUL_ROWS:
            return super().forward(x)
        return F.linear(padded_rows(rows), self.weight, self.bias)[:m].view(*x.shape[:-1], self.out_features)


def pad_linear_rows(model: nn.Module) -> int:
    """Make every plain ``nn.Linear`` of ``model`` a ``RowPaddedLinear`` in place (the same parameters,
    so tied weights stay tied); returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = RowPaddedLinear
            count += 1
    return count
