"""Which runner serves a model: ``--runner generate|pooling|auto``, ``--convert embed|classify|auto`` and
vLLM's older ``--task``, resolved against the model's folder (its config.json's architectures)."""

from __future__ import annotations

from pathlib import Path

from pagellm.config import EngineArgs
from pagellm.model.encoders import ENCODER_REGISTRY, folder_architectures, is_encoder_folder

_TASKS = {"generate": ("generate", "auto"), "embed": ("pooling", "embed"), "embedding": ("pooling", "embed"),
          "classify": ("pooling", "classify"), "score": ("pooling", "classify")}


def _runner_and_convert(args: EngineArgs) -> tuple[str, str]:
    runner, convert = args.runner, args.convert
    if args.task != "auto":
        task_runner, task_convert = _TASKS[args.task]
        if runner not in ("auto", task_runner) or (task_convert != "auto" and convert not in ("auto", task_convert)):
            raise ValueError(f"--task {args.task} means --runner {task_runner}"
                             f"{'' if task_convert == 'auto' else ' --convert ' + task_convert}; it contradicts "
                             f"--runner {runner} --convert {convert}: give one or the other")
        runner = task_runner
        convert = task_convert if convert == "auto" else convert
    return runner, convert


def pooling_task(args: EngineArgs) -> str | None:
    """None where the model generates; else the pooling runner's conversion, ``embed`` or ``classify``.
    ValueError where the flags ask for what the model cannot do."""
    runner, convert = _runner_and_convert(args)
    folder = Path(args.model).expanduser() if args.model is not None else None
    encoder = folder is not None and folder.is_dir() and is_encoder_folder(folder)
    if runner == "auto":
        runner = "pooling" if encoder else "generate"
    if runner == "generate":
        if encoder and folder is not None:
            raise ValueError(f"{args.model} is an encoder ({', '.join(folder_architectures(folder))}): it embeds or "
                             "scores, it does not generate text; serve it with --runner pooling")
        if convert not in ("auto", "none"):
            raise ValueError(f"--convert {convert} applies to --runner pooling")
        return None
    if not encoder:
        archs = folder_architectures(folder) if folder is not None and folder.is_dir() else []
        what = ", ".join(archs) if archs else "the default model" if folder is None else "a GGUF file or unknown model"
        raise ValueError(f"--runner pooling runs encoder models ({', '.join(sorted(ENCODER_REGISTRY))}); "
                         f"{args.model or 'the default model'} is {what}: serve it with --runner generate")
    assert folder is not None
    classifier = any(ENCODER_REGISTRY[a].is_classifier for a in folder_architectures(folder) if a in ENCODER_REGISTRY)
    if convert in ("auto", "none"):
        return "classify" if classifier else "embed"
    if convert == "classify" and not classifier:
        raise ValueError(f"--convert classify needs a sequence-classification head; {args.model} "
                         f"({', '.join(folder_architectures(folder))}) has none: use --convert embed")
    return convert
