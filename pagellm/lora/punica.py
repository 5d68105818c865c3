"""The batched LoRA op: each row of a step's flat batch adds its own adapter's ``x @ A^T @ B^T``.

Rows are grouped by adapter once per step (``LoRAStep``); each fused projection then runs two small
matmuls per adapter present, on that adapter's rows only (``index_select`` / ``index_add_``; a group
that is every row of the step needs neither), as Punica's segmented gather does. Base rows cost
nothing, and a step without adapter rows never reaches this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagellm.lora.weights import LoRAWeights, TargetKey

# (an adapter's weights, its rows of the batch; None: every row)
Group = tuple[LoRAWeights, torch.Tensor | None]


def group_rows(row_adapters: torch.Tensor, adapters: dict[int, LoRAWeights]) -> list[Group]:
    """The rows of each adapter in ``row_adapters`` ([num_rows] adapter id per row, 0: the base model)."""
    groups: list[Group] = []
    n = row_adapters.shape[0]
    for adapter_id, weights in adapters.items():
        rows = torch.nonzero(row_adapters == adapter_id).flatten()
        if rows.numel():
            groups.append((weights, None if rows.numel() == n else rows))
    return groups


@dataclass
class LoRAStep:
    """One step's adapters: the id of each row's adapter (0: base) and the rows of each adapter.

    The last layer may compute fewer rows after its attention (only those the LM head reads:
    ``kept_rows``); its projections then find their groups among those rows."""

    row_adapters: torch.Tensor  # [num_rows] int64
    adapters: dict[int, LoRAWeights]
    kept_rows: torch.Tensor | None = None  # [num_kept] rows of the batch the last layer keeps
    _groups: dict[int, list[Group]] = field(default_factory=dict)

    def groups(self, num_rows: int) -> list[Group]:
        """The groups of a projection whose input has ``num_rows`` rows."""
        got = self._groups.get(num_rows)
        if got is None:
            if num_rows == self.row_adapters.shape[0]:
                got = group_rows(self.row_adapters, self.adapters)
            elif self.kept_rows is not None and num_rows == self.kept_rows.shape[0]:
                got = group_rows(self.row_adapters[self.kept_rows], self.adapters)
            else:
                raise RuntimeError(f"LoRA: a projection of {num_rows} rows in a step of "
                                   f"{self.row_adapters.shape[0]} rows")
            self._groups[num_rows] = got
        return got


def add_lora(out: torch.Tensor, x: torch.Tensor, key: TargetKey, groups: list[Group]) -> torch.Tensor:
    """``out`` (the base projection of ``x``) plus each group's adapter on its rows, in place."""
    for weights, rows in groups:
        ab = weights.tensors.get(key)
        if ab is None:
            continue  # this adapter leaves the projection alone
        a_t, b_t = ab
        if rows is None:
            out.addmm_(x @ a_t, b_t)
        else:
            out.index_add_(0, rows, (x.index_select(0, rows) @ a_t) @ b_t)
    return out
