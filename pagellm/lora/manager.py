"""The worker's adapters: the slots of the adapters a step may use (``max_loras``, least recently used
first out) over a cache of loaded adapters (``max_cpu_loras``), and the hooks that apply them.

Each targeted projection of the model gets a forward hook (``add_lora``), which returns at once when
the step has no adapter rows (``current`` is None); the model's modules are not replaced, so loading,
packing and sharding see the base model they know.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pagellm.lora.peft_config import read_adapter_config
from pagellm.lora.punica import LoRAStep, add_lora
from pagellm.lora.request import LoRARequest
from pagellm.lora.weights import LoRAWeights, TargetKey, TargetLayout, load_lora_weights

logger = logging.getLogger(__name__)


class LoRAManager:
    """Adapters by ``lora_int_id``: those registered (their ``LoRARequest``), those loaded (an LRU of
    ``max_cpu_loras``), those in slots on the model's device (an LRU of ``max_loras``)."""

    def __init__(self, targets: dict[TargetKey, tuple[nn.Module, TargetLayout]], max_loras: int,
                 max_cpu_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.layout = {key: layout for key, (_, layout) in targets.items()}
        self.max_loras, self.max_cpu_loras, self.max_rank = max_loras, max(max_cpu_loras, max_loras), max_rank
        self.dtype, self.device = dtype, device
        self.requests: dict[int, LoRARequest] = {}
        self.loaded: OrderedDict[int, LoRAWeights] = OrderedDict()
        self.slots: OrderedDict[int, LoRAWeights] = OrderedDict()
        # The running step's adapters; None: no row of the step has one (the hooks return at once).
        self.current: LoRAStep | None = None
        self.loads = 0  # adapters read from disk (tests and the log)
        for key, (module, _) in targets.items():
            module.register_forward_hook(self._hook(key))

    def _hook(self, key: TargetKey) -> Callable[[nn.Module, tuple[Any, ...], torch.Tensor], torch.Tensor | None]:
        def hook(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor | None:
            step = self.current
            if step is None:
                return None
            x = args[0]
            return add_lora(out, x, key, step.groups(x.shape[0]))
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
        self.slots.pop(adapter_id, None)

    def _weights(self, adapter_id: int, keep: set[int]) -> LoRAWeights:
        """The adapter in a slot, loading it (from the cache, else its files) where it is not; the least
        recently used slot not in ``keep`` makes room."""
        slot = self.slots.get(adapter_id)
        if slot is not None:
            self.slots.move_to_end(adapter_id)
            return slot
        cpu = self.loaded.get(adapter_id)
        if cpu is None:
            req = self.requests[adapter_id]
            cfg = read_adapter_config(req.lora_path, self.max_rank, req.lora_name)
            cpu = load_lora_weights(cfg, self.layout, self.dtype, req.lora_name)
            self.loads += 1
            logger.info("LoRA adapter %r loaded from %s (rank %d, %.1f MiB)", req.lora_name, req.lora_path,
                        cpu.rank, cpu.nbytes / 2**20)
            self.loaded[adapter_id] = cpu
            while len(self.loaded) > self.max_cpu_loras:
                self.loaded.popitem(last=False)
        self.loaded.move_to_end(adapter_id)
        while len(self.slots) >= self.max_loras:
            victim = next((i for i in self.slots if i not in keep), None)
            if victim is None:
                raise RuntimeError(f"LoRA: more than max_loras={self.max_loras} adapters in one step")
            del self.slots[victim]
        slot = cpu if cpu.tensors and next(iter(cpu.tensors.values()))[0].device == self.device else cpu.to(self.device)
        self.slots[adapter_id] = slot
        return slot

    def begin_step(self, ids: Sequence[int], counts: Sequence[int],
                   kept_rows: torch.Tensor | None) -> LoRAStep | None:
        """The step whose rows are ``counts[i]`` rows of adapter ``ids[i]`` each (0: the base model), in
        batch order; None where none has an adapter."""
        wanted = {i for i in ids if i}
        if not wanted:
            return None
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"LoRA: {len(wanted)} adapters in one step, more than max_loras={self.max_loras}")
        adapters = {i: self._weights(i, wanted) for i in sorted(wanted)}
        row_adapters = torch.repeat_interleave(torch.tensor(ids, dtype=torch.int64),
                                               torch.tensor(counts, dtype=torch.int64)).to(self.device)
        return LoRAStep(row_adapters, adapters, kept_rows)
