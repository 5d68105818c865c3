"""The batched LoRA op: each row of a step's flat batch adds its own adapter's ``x @ A^T @ B^T``.

Rows are planned by adapter once per step (``LoRAStep``). A run of at least ``LONG_RUN`` consecutive rows
of one adapter (a prompt's chunk: a sequence's rows are contiguous) multiplies its slice of the batch in
place, no copy. The other rows (decodes) then run either

- **bmm**: the adapter rows gathered into one ``[slots, rows per slot, in]`` batch (padded with a zero
  row), two ``bmm``s against the slots' stacked A and B, and one ``index_add_`` back (padding adds
  zeros): five calls whatever the number of adapters, for steps whose adapters have similar row
  counts (decodes); or
- **segments**: per adapter, its rows' two small matmuls (``index_select`` / ``index_add_``; none where it
  has every row), for steps where one adapter has most rows (a long prompt), where padding would waste.

Base rows cost nothing, and a step without adapter rows never reaches this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagellm.lora.weights import LoRAWeights, TargetKey

# (an adapter's weights, its rows of the batch; None: every row)
Group = tuple[LoRAWeights, torch.Tensor | None]
# A projection's A^T of every slot, [slots, in, parts * max_rank] (part j in columns j * max_rank on), and
# each part's B^T, [slots, max_rank, width] (zero where unused).
Stacks = dict[TargetKey, tuple[torch.Tensor, list[torch.Tensor]]]
# bmm's slack: rows computed (slots x the largest slot's rows) may be this many times the adapter rows.
BMM_PADDING = 1.5
# Consecutive rows of one adapter computed as a slice of the batch (fewer: among the gathered rows).
LONG_RUN = 16
# An adapter with every row of a step, up to this many, multiplies its block-diagonal B in one call.
FEW_ROWS = 64


@dataclass
class Plan:
    """How a projection of ``num_rows`` rows adds the adapters: ``groups`` (segments) or the bmm indices."""

    groups: list[Group]
    runs: list[tuple[int, int, LoRAWeights]] = field(default_factory=list)  # (first row, end, adapter)
    gather: torch.Tensor | None = None  # [slots, m] rows of x (num_rows: the zero row)
    scatter: torch.Tensor | None = None  # [slots * m] rows of out (padding: row 0, which gets zeros)


def plan_rows(row_slots: torch.Tensor, slot_weights: list[LoRAWeights | None]) -> Plan:
    """The plan for rows whose slot is ``row_slots`` ([num_rows], -1: the base model)."""
    n = row_slots.shape[0]
    runs = []
    if n >= LONG_RUN:
        ends = (torch.nonzero(row_slots[1:] != row_slots[:-1]).flatten() + 1).tolist() + [n]
        start = 0
        for end in ends:
            slot = int(row_slots[start])
            weights = slot_weights[slot] if slot >= 0 else None
            if end - start >= LONG_RUN and weights is not None:
                runs.append((start, end, weights))
            start = end
        if runs:
            row_slots = row_slots.clone()
            for start, end, _ in runs:
                row_slots[start:end] = -1  # (done as slices)
    plan = _plan_gathered(row_slots, slot_weights)
    plan.runs = runs
    return plan


def _plan_gathered(row_slots: torch.Tensor, slot_weights: list[LoRAWeights | None]) -> Plan:
    n = row_slots.shape[0]
    rows = [torch.nonzero(row_slots == s).flatten() for s in range(len(slot_weights))]
    groups: list[Group] = [(w, None if r.numel() == n else r)
                           for w, r in zip(slot_weights, rows) if w is not None and r.numel()]
    counts = [r.numel() for r in rows]
    lora_rows = sum(counts)
    if len(groups) < 2 or len(slot_weights) * max(counts) > BMM_PADDING * lora_rows:
        return Plan(groups)
    m = max(counts)
    gather = torch.full((len(rows), m), n, dtype=torch.int64, device=row_slots.device)
    for s, r in enumerate(rows):
        gather[s, : r.numel()] = r
    return Plan(groups, gather=gather, scatter=torch.where(gather == n, 0, gather).flatten())


@dataclass
class LoRAStep:
    """One step's adapters: each row's slot (-1: the base model) and the slots' weights and stacks.

    The last layer may compute fewer rows after its attention (only those the LM head reads:
    ``kept_rows``); its projections then plan among those rows."""

    row_slots: torch.Tensor  # [num_rows] int64
    slot_weights: list[LoRAWeights | None]
    stacks: Stacks
    kept_rows: torch.Tensor | None = None  # [num_kept] rows of the batch the last layer keeps
    _plans: dict[int, Plan] = field(default_factory=dict)

    def plan(self, num_rows: int) -> Plan:
        """The plan of a projection whose input has ``num_rows`` rows."""
        got = self._plans.get(num_rows)
        if got is None:
            if num_rows == self.row_slots.shape[0]:
                got = plan_rows(self.row_slots, self.slot_weights)
            elif self.kept_rows is not None and num_rows == self.kept_rows.shape[0]:
                got = plan_rows(self.row_slots[self.kept_rows], self.slot_weights)
            else:
                raise RuntimeError(f"LoRA: a projection of {num_rows} rows in a step of {self.row_slots.shape[0]}")
            self._plans[num_rows] = got
        return got


def add_lora(out: torch.Tensor, x: torch.Tensor, key: TargetKey, step: LoRAStep) -> torch.Tensor:
    """``out`` (the base projection of ``x``) plus each row's adapter, in place."""
    plan = step.plan(x.shape[0])
    for start, end, weights in plan.runs:
        fused = weights.tensors.get(key)
        if fused is not None:
            a, b_parts = fused
            h = x[start:end] @ a
            for k, (offset, b) in enumerate(b_parts):
                out[start:end, offset : offset + b.shape[1]].addmm_(h[:, k * weights.rank : (k + 1) * weights.rank], b)
    if plan.gather is not None:
        stacked = step.stacks.get(key)
        if stacked is None:
            return out  # no adapter of the slots adapts this projection
        a_t, b_stacks = stacked
        x_ext = torch.cat((x, x.new_zeros(1, x.shape[1])))
        h = torch.bmm(x_ext[plan.gather], a_t)
        rank = b_stacks[0].shape[1]
        ys = [torch.bmm(h[:, :, j * rank : (j + 1) * rank], b) for j, b in enumerate(b_stacks)]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        assert plan.scatter is not None
        return out.index_add_(0, plan.scatter, y.flatten(0, 1))
    for weights, rows in plan.groups:
        fused = weights.tensors.get(key)
        if fused is None:
            continue  # this adapter leaves the projection alone
        a, b_parts = fused
        h = (x if rows is None else x.index_select(0, rows)) @ a
        if rows is None and x.shape[0] <= FEW_ROWS and key in weights.full_b:
            out.addmm_(h, weights.full_b[key])  # (one call for every part: a decode stream's)
            continue
        rank = weights.rank
        for k, (offset, b) in enumerate(b_parts):
            y = h[:, k * rank : (k + 1) * rank] @ b
            view = out[:, offset : offset + b.shape[1]]  # (the part's columns: no zeros for the others)
            if rows is None:
                view.add_(y)
            else:
                view.index_add_(0, rows, y)
    return out
