"""The engine's LoRA adapters (``--enable-lora``): the worker's ``LoRAManager`` attached to the model
runner, and each ``LoRARequest`` checked before its request is queued.

An adapter is checked once per name and path: its folder (a hub id is downloaded first, through
``model/hub.py``), its config against ``--max-lora-rank`` and the projections pagellm adapts, its
tensors against the model's shapes; a request naming it then costs a dictionary lookup.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from pagellm.config import EngineArgs
from pagellm.lora.adapter_files import read_adapter
from pagellm.lora.peft_config import LoRAError
from pagellm.lora.request import LoRARequest
from pagellm.lora.weights import load_lora_weights
from pagellm.model.hub import HubSettings, download_adapter, is_hub_id
from pagellm.worker.lora_targets import make_lora_manager
from pagellm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class LoRAService:
    """The adapters an engine serves: checked ``LoRARequest``s, and those registered by name (the
    server's ``--lora-modules`` and ``/v1/load_lora_adapter``)."""

    def __init__(self, args: EngineArgs, runner: ModelRunner, dtype: torch.dtype, device: torch.device) -> None:
        self.max_loras, self.max_rank = args.max_loras, args.max_lora_rank
        self.hub = HubSettings(token=args.hf_token, cache_dir=args.download_dir)
        self.dtype = dtype
        cpu_loras = args.max_cpu_loras or args.max_loras
        runner.lora = self.manager = make_lora_manager(runner.model, args.max_loras, cpu_loras, args.max_lora_rank,
                                                       dtype, device)
        self._checked: dict[tuple[str, str], LoRARequest] = {}  # (name, path as given) -> with its local path
        self._ids: dict[int, str] = {}  # lora_int_id -> name
        self.registered: dict[str, LoRARequest] = {}  # by name: the adapters the server lists
        self._lock = threading.Lock()  # (the server checks requests while a step runs)
        self._next_id = 1

    def check(self, request: LoRARequest) -> LoRARequest:
        """``request`` with a local path, its adapter checked; LoRAError (a ValueError) saying what is wrong."""
        if not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, not {type(request).__name__}")
        key = (request.lora_name, request.lora_path)
        with self._lock:
            done = self._checked.get(key)
            if done is not None and done.lora_int_id == request.lora_int_id:
                return done
            known = self._ids.get(request.lora_int_id)
            if known is not None and known != request.lora_name:
                raise LoRAError(f"lora_int_id {request.lora_int_id} is already adapter {known!r}: give each adapter "
                                "its own id")
        local = self._local_path(request)
        cfg = read_adapter(local, self.max_rank, request.lora_name)
        load_lora_weights(cfg, self.manager.layout, self.dtype, request.lora_name,  # (shapes against the model)
                          self.manager.model_type)
        checked = LoRARequest(request.lora_name, request.lora_int_id, str(local), request.base_model_name)
        with self._lock:  # (under the local path too: the checked request comes back here with it)
            self._checked[key] = self._checked[(checked.lora_name, checked.lora_path)] = checked
            self._ids[request.lora_int_id] = request.lora_name
        logger.info("LoRA adapter %r: %s (rank %d, scaling %g, %s)", request.lora_name, local, cfg.rank, cfg.scaling,
                    ", ".join(cfg.target_modules))
        return checked

    def _local_path(self, request: LoRARequest) -> Path:
        path = request.lora_path
        if not Path(path).expanduser().exists() and is_hub_id(path) and not path.endswith(".gguf"):
            return download_adapter(path, self.hub)
        return Path(path).expanduser()

    # ------------------------------------------------------------ by name (the server)
    def add(self, name: str, path: str) -> LoRARequest:
        """Register adapter ``name`` from ``path`` (a fresh id), checked; ValueError if the name is taken."""
        if name in self.registered:
            raise LoRAError(f"the LoRA adapter {name!r} is already loaded: unload it first, or pick another name")
        with self._lock:
            while self._next_id in self._ids:
                self._next_id += 1
            adapter_id = self._next_id
            self._next_id += 1
        checked = self.check(LoRARequest(name, adapter_id, path))
        self.registered[name] = checked
        return checked

    def remove(self, name: str) -> LoRARequest:
        """Forget adapter ``name`` (its running requests finish with it); KeyError if it is unknown."""
        request = self.registered.pop(name)
        with self._lock:
            self._checked = {k: v for k, v in self._checked.items() if v.lora_int_id != request.lora_int_id}
            self._ids.pop(request.lora_int_id, None)
        return request
