"""The worker's adapters: the slots of the adapters a step may use (``max_loras``, least recently used
first out) over a cache of loaded adapters (``max_cpu_loras``), and the hooks that apply them.

Each targeted projection of the model gets a forward hook (``add_lora``), which returns at once when
the step has no adapter rows (``current`` is None); the model's modules are not replaced, so loading,
packing and sharding see the base model they know.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pagellm.lora.adapter_files import read_adapter
from pagellm.lora.punica import LoRAStep, Stacks, add_lora
from pagellm.lora.request import LoRARequest
from pagellm.lora.weights import LoRAWeights, TargetKey, TargetLayout, load_lora_weights

logger = logging.getLogger(__name__)


class LoRAManager:
    """Adapters by ``lora_int_id``: those registered (their ``LoRARequest``), those loaded (an LRU of
    ``max_cpu_loras``), those in slots on the model's device (an LRU of ``max_loras``)."""

    def __init__(self, targets: dict[TargetKey, tuple[nn.Module, TargetLayout]], max_loras: int,
                 max_cpu_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 model_type: str = "") -> None:
        self.model_type = model_type  # (a GGUF adapter's base architecture must be the model's)
        self.layout = {key: layout for key, (_, layout) in targets.items()}
        self.max_loras, self.max_cpu_loras, self.max_rank = max_loras, max(max_cpu_loras, max_loras), max_rank
        self.dtype, self.device = dtype, device
        self.requests: dict[int, LoRARequest] = {}
        self.loaded: OrderedDict[int, LoRAWeights] = OrderedDict()
        # The slots: adapter id -> slot index, least recently used first; each slot's weights; and per
        # projection the slots' A^T and B^T stacked for the batched op (allocated when first needed).
        self.slots: OrderedDict[int, int] = OrderedDict()
        self.slot_weights: list[LoRAWeights | None] = [None] * max_loras
        self.stacks: Stacks = {}
        # The running step's adapters; None: no row of the step has one (the hooks return at once).
        self.current: LoRAStep | None = None
        self.loads = 0  # adapters read from disk (tests and the log)
        for key, (module, _) in targets.items():
            module.register_forward_hook(self._hook(key))

    def _hook(self, key: TargetKey) -> Callable[[nn.Module, tuple[Any, ...], torch.Tensor], torch.Tensor | None]:
        def hook(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor | None:
            step = self.current
            return None if step is None else add_lora(out, args[0], key, step)
        return hook

    def register(self, request: LoRARequest) -> None:
        """Know ``request``'s adapter by its id (a new path under a known id replaces the adapter)."""
        known = self.requests.get(request.lora_int_id)
        if known is not None and known.lora_path != request.lora_path:
            self.remove(request.lora_int_id)
        self.requests[request.lora_int_id] = request

    def remove(self, adapter_id: int) -> None:
        """Forget an adapter (unloaded at run time)."""
        self.requests.pop(adapter_id, None)
        self.loaded.pop(adapter_id, None)
        slot = self.slots.pop(adapter_id, None)
        if slot is not None:
            self._fill(slot, None)

    def _slot(self, adapter_id: int, keep: set[int]) -> int:
        """The adapter's slot, loading it (from the cache, else its files) where it has none; the least
        recently used slot not in ``keep`` makes room."""
        slot = self.slots.get(adapter_id)
        if slot is not None:
            self.slots.move_to_end(adapter_id)
            return slot
        cpu = self.loaded.get(adapter_id)
        if cpu is None:
            req = self.requests[adapter_id]
            cfg = read_adapter(req.lora_path, self.max_rank, req.lora_name)
            cpu = load_lora_weights(cfg, self.layout, self.dtype, req.lora_name, self.model_type)
            self.loads += 1
            logger.info("LoRA adapter %r loaded from %s (rank %d, %.1f MiB)", req.lora_name, req.lora_path,
                        cpu.rank, cpu.nbytes / 2**20)
            self.loaded[adapter_id] = cpu
            while len(self.loaded) > self.max_cpu_loras:
                self.loaded.popitem(last=False)
        self.loaded.move_to_end(adapter_id)
        free = [i for i, w in enumerate(self.slot_weights) if w is None]
        if free:
            slot = free[0]
        else:
            victim = next((i for i in self.slots if i not in keep), None)
            if victim is None:
                raise RuntimeError(f"LoRA: more than max_loras={self.max_loras} adapters in one step")
            slot = self.slots.pop(victim)
        self._fill(slot, cpu.to(self.device))
        self.slots[adapter_id] = slot
        return slot

    def _fill(self, slot: int, weights: LoRAWeights | None) -> None:
        """Put ``weights`` (None: nothing) in ``slot``, and in the stacks (zero where it adapts nothing)."""
        self.slot_weights[slot] = weights
        for key, layout in self.layout.items():
            fused = weights.tensors.get(key) if weights is not None else None
            stacked = self.stacks.get(key)
            if stacked is None:
                if fused is None:
                    continue
                dt, dev = self.dtype, self.device
                stacked = (torch.zeros(self.max_loras, layout.in_features, len(layout.parts) * self.max_rank,
                                       dtype=dt, device=dev),
                           [torch.zeros(self.max_loras, self.max_rank, width, dtype=dt, device=dev)
                            for _, width in layout.parts])
                self.stacks[key] = stacked
            a_stack, b_stacks = stacked
            a_stack[slot].zero_()
            for b_stack in b_stacks:
                b_stack[slot].zero_()
            if fused is None:
                continue
            a_t, b_parts = fused
            starts = list(itertools.accumulate((w for _, w in layout.parts), initial=0))
            r = self.max_rank
            for k, (offset, b_t) in enumerate(b_parts):
                j = starts.index(offset)  # the part's place in the projection
                rank = b_t.shape[0]
                a_stack[slot, :, j * r : j * r + rank] = a_t[:, k * rank : (k + 1) * rank]
                b_stacks[j][slot, :rank] = b_t

    def begin_step(self, ids: Sequence[int], counts: Sequence[int],
                   kept_rows: torch.Tensor | None) -> LoRAStep | None:
        """The step whose rows are ``counts[i]`` rows of adapter ``ids[i]`` each (0: the base model), in
        batch order; None where none has an adapter."""
        wanted = {i for i in ids if i}
        if not wanted:
            return None
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"LoRA: {len(wanted)} adapters in one step, more than max_loras={self.max_loras}")
        slot_of = {i: self._slot(i, wanted) for i in sorted(wanted)}
        slots = [slot_of[i] if i else -1 for i in ids]
        row_slots = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int64),
                                            torch.tensor(counts, dtype=torch.int64)).to(self.device)
        return LoRAStep(row_slots, self.slot_weights, self.stacks, kept_rows)
