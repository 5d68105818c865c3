"""Which runner serves a model: ``--runner generate|pooling|auto``, ``--convert embed|classify|auto`` and
vLLM's older ``--task``, resolved against the model's folder (its config.json's architectures)."""

from __future__ import annotations

from pathlib import Path

from pagellm.config import EngineArgs
from pagellm.model.decoder_pooling import DECODER_CLASSIFIERS, is_decoder_architecture
from pagellm.model.encoders import ENCODER_REGISTRY, folder_architectures
from pagellm.model.gguf_encoder import gguf_encoder_architecture
from pagellm.model.registry import MODEL_REGISTRY

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


def _architectures(args: EngineArgs, folder: Path | None) -> list[str]:
    """The model's architectures, ``--hf-overrides``' where it sets them (vLLM's way to serve a causal LM as
    a ``*ForSequenceClassification``)."""
    overrides = args.hf_overrides if isinstance(args.hf_overrides, dict) else {}
    if isinstance(overrides.get("architectures"), list):
        return [str(a) for a in overrides["architectures"]]
    if folder is not None and (gguf_arch := gguf_encoder_architecture(folder)) is not None:
        return ["BertModel" if gguf_arch == "bert" else "NomicBertModel"]  # (gguf_encoder.py's folder)
    return folder_architectures(folder) if folder is not None and folder.is_dir() else []


def pooling_task(args: EngineArgs) -> str | None:
    """None where the model generates; else the pooling runner's conversion, ``embed`` or ``classify``.
    ValueError where the flags ask for what the model cannot do."""
    runner, convert = _runner_and_convert(args)
    folder = Path(args.model).expanduser() if args.model is not None else None
    archs = _architectures(args, folder)
    encoder = any(a in ENCODER_REGISTRY for a in archs)
    decoder_classifier = any(a in DECODER_CLASSIFIERS for a in archs)
    if runner == "auto":
        runner = "pooling" if encoder or decoder_classifier else "generate"
    if runner == "generate":
        if encoder or decoder_classifier:
            raise ValueError(f"{args.model} is {'an encoder' if encoder else 'a classifier'} ({', '.join(archs)}): "
                             "it embeds or scores, it does not generate text; serve it with --runner pooling")
        if convert not in ("auto", "none"):
            raise ValueError(f"--convert {convert} applies to --runner pooling")
        return None
    if not (encoder or (is_decoder_architecture(archs) and folder is not None and folder.is_dir())):
        what = ("the default model" if folder is None else "a GGUF file of a generative model" if folder.is_file()
                else ", ".join(archs) or "an unknown model")
        raise ValueError(f"--runner pooling runs encoder models ({', '.join(sorted(ENCODER_REGISTRY))}) and "
                         f"decoders ({', '.join(sorted(MODEL_REGISTRY))}, {', '.join(sorted(DECODER_CLASSIFIERS))}) "
                         f"from a model folder, and GGUF files of bert and nomic-bert; "
                         f"{args.model or 'the default model'} is {what}")
    overrides = args.hf_overrides if isinstance(args.hf_overrides, dict) else {}
    classifier = (decoder_classifier or bool(overrides.get("classifier_from_token"))
                  or any(ENCODER_REGISTRY[a].is_classifier for a in archs if a in ENCODER_REGISTRY))
    if convert in ("auto", "none"):
        return "classify" if classifier else "embed"
    if convert == "classify" and not classifier:
        raise ValueError(f"--convert classify needs a sequence-classification head; {args.model} "
                         f"({', '.join(archs)}) has none: use --convert embed, or for a decoder reranker such as "
                         """Qwen3-Reranker --hf-overrides '{"architectures": ["Qwen3ForSequenceClassification"], """
                         """"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'""")
    return convert
