"""vLLM's engine arguments that scripts pass without thinking, as ``EngineArgs`` fields.

Some have their vLLM meaning here (``max_logprobs``, ``hf_overrides``, ``override_generation_config``);
the rest concern CUDA, model hubs or features pagellm does not have, and change nothing: each such
argument, when given, logs one line naming it and why (once per process). Values are checked as
vLLM checks them, and the JSON ones (the CLI's text) become dicts.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pagellm.sampling_params import SAMPLING_KEYS
from pagellm.speculative_config import SpeculativeConfig

logger = logging.getLogger("pagellm.engine")

TOKENIZER_MODES = ("auto", "hf", "slow", "mistral", "custom")
EXECUTOR_BACKENDS = ("mp", "uni", "ray", "external_launcher")
OPTIMIZATION_LEVELS = (0, 1, 2, 3)
HUB_ONLY = "the model is a local path, which ignores it (it applies to hub model ids)"
NO_COMPILE = ("pagellm runs the model eagerly (no torch.compile, no CUDA graphs); its native CPU kernels are "
              "compiled once, on first use")

_logged: set[str] = set()


def _flag(name: str) -> str:
    return f"{name} (--{name.replace('_', '-')})"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def json_object(name: str, value: Any) -> dict[str, Any] | None:
    """``value`` as a dict: a dict as it is, a JSON object's text parsed (the CLI's form), None kept."""
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{_flag(name)} is not valid JSON ({e.msg} at character {e.pos}): give a JSON object "
                             """such as '{"key": 1}'""") from None
        if isinstance(parsed, dict):
            return parsed
    raise ValueError(f"{_flag(name)} must be a JSON object (a dict in Python), got {value!r}")


def _positive_or_none(args: Any, name: str) -> None:
    v = getattr(args, name)
    if v is not None and (not _is_int(v) or v < 1):
        raise ValueError(f"{_flag(name)} must be a positive integer, got {v!r}")


def check_vllm_engine_fields(args: Any) -> None:
    """Check the vLLM fields of ``args`` (an ``EngineArgs``); parse their JSON text into dicts."""
    for name in ("revision", "download_dir", "tokenizer_revision", "hf_token", "gguf_file"):
        v = getattr(args, name)
        if v is not None and (not isinstance(v, str) or not v):
            raise ValueError(f"{_flag(name)} must be a non-empty string, got {v!r}")
    if args.tokenizer_mode not in TOKENIZER_MODES:
        raise ValueError(f"{_flag('tokenizer_mode')} must be one of {', '.join(TOKENIZER_MODES)}, "
                         f"got {args.tokenizer_mode!r}")
    if not _is_int(args.max_logprobs) or args.max_logprobs < -1:
        raise ValueError(f"{_flag('max_logprobs')} must be an integer >= 0 (or -1: no limit), "
                         f"got {args.max_logprobs!r}")
    if args.distributed_executor_backend is not None and args.distributed_executor_backend not in EXECUTOR_BACKENDS:
        raise ValueError(f"{_flag('distributed_executor_backend')} must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                         f"got {args.distributed_executor_backend!r}")
    _positive_or_none(args, "max_seq_len_to_capture")
    _positive_or_none(args, "max_parallel_loading_workers")
    args.hf_overrides = json_object("hf_overrides", args.hf_overrides)
    args.override_generation_config = json_object("override_generation_config", args.override_generation_config)
    _check_generation_overrides(args.override_generation_config)
    args.compilation_config = _compilation_config(args.compilation_config)
    args.speculative_config = json_object("speculative_config", args.speculative_config)
    if args.speculative_config is not None:
        SpeculativeConfig.from_dict(args.speculative_config)  # (raises, naming what is wrong)
    if args.optimization_level is not None and args.optimization_level not in OPTIMIZATION_LEVELS:
        raise ValueError(f"{_flag('optimization_level')} (-O) must be 0, 1, 2 or 3, got {args.optimization_level!r}")


def _check_generation_overrides(overrides: dict[str, Any] | None) -> None:
    if not overrides:
        return
    unknown = sorted(set(overrides) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"{_flag('override_generation_config')} has keys pagellm does not use: {', '.join(unknown)}; "
                         f"it takes generation_config.json's {', '.join(SAMPLING_KEYS)}")


def _compilation_config(value: Any) -> dict[str, Any] | int | None:
    """vLLM's forms: a JSON object, or an optimization level (``3``, or its text ``"3"``)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if _is_int(value):
        if value not in OPTIMIZATION_LEVELS:
            raise ValueError(f"{_flag('compilation_config')} as a level must be 0, 1, 2 or 3, got {value!r}")
        return value
    return json_object("compilation_config", value)


def ignored_engine_args(args: Any, from_hub: bool = False) -> dict[str, str]:
    """The vLLM arguments given in ``args`` that change nothing here: ``--flag value`` -> why
    (``from_hub``: the model is a hub id, which the hub's flags apply to)."""
    out: dict[str, str] = {}

    def note(name: str, why: str) -> None:
        value = getattr(args, name)
        shown = json.dumps(value) if isinstance(value, dict) else value
        out[f"--{name.replace('_', '-')}" + ("" if value is True else f" {shown}")] = why

    if not from_hub:
        for name in ("revision", "download_dir"):
            if getattr(args, name, None) is not None:
                note(name, HUB_ONLY)
    if args.tokenizer_mode not in ("auto", "hf"):
        note("tokenizer_mode", "pagellm loads every tokenizer with transformers' AutoTokenizer (its fast tokenizer)")
    if args.distributed_executor_backend is not None:
        note("distributed_executor_backend", "tensor-parallel ranks are processes pagellm starts itself (no Ray); "
             "other hosts join with `pagellm serve --nnodes N --node-rank R`")
    if args.max_seq_len_to_capture is not None:
        note("max_seq_len_to_capture", "pagellm captures no CUDA graphs")
    if args.max_parallel_loading_workers is not None:
        note("max_parallel_loading_workers", "pagellm loads the weights in one pass, a tensor at a time")
    if args.compilation_config is not None:
        note("compilation_config", NO_COMPILE)
    if args.optimization_level is not None:
        note("optimization_level", NO_COMPILE)
    if args.async_scheduling:
        note("async_scheduling", "pagellm schedules each step once the previous step's tokens are in")
    return out


def log_ignored_engine_args(args: Any, from_hub: bool = False) -> None:
    """One INFO line per vLLM argument given that changes nothing here, once per process."""
    for flag, why in ignored_engine_args(args, from_hub).items():
        if flag not in _logged:
            _logged.add(flag)
            logger.info("%s has no effect: %s", flag, why)


# vLLM engine arguments that mean nothing to pagellm at the value given: name -> (the values accepted,
# why). Scripts written for vLLM pass them; any other value is an error that says what is supported.
VLLM_ONLY_ARGS: dict[str, tuple[tuple[Any, ...], str]] = {
    "skip_tokenizer_init": ((False,), "pagellm needs the tokenizer (stop strings, chat templates)"),
    "cpu_offload_gb": ((0, 0.0), "weights stay on the device they run on"),
    "disable_custom_all_reduce": ((False, True), "the ranks' all-reduces are torch.distributed's"),
}


def check_vllm_only_arg(name: str, value: Any) -> None:
    """ValueError unless ``value`` is one at which vLLM's argument ``name`` changes nothing here."""
    accepted, why = VLLM_ONLY_ARGS[name]
    if not any(value == a and type(value) is type(a) for a in accepted):
        raise ValueError(f"{name}={value!r} is not supported: {why} (accepted: "
                         f"{', '.join(repr(a) for a in accepted)})")
