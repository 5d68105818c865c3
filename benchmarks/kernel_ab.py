"""The native kernels of another revision against the working tree's, step by step on W1.

Builds ``pagellm/kernels/cpu_kernels.c`` as it is at ``--base`` (a git revision, or a path to a C file)
next to the working tree's. This machine's speed drifts by several percent over seconds, more than
most kernel changes gain, so whole runs one after the other compare poorly; here the two builds take
turns within each W1 run, step by step in ABBA order (A B, B A, ...), and each step is compared with
its neighbour of the same kind (prompt or decode) and size, and reports the paired differences.
Beforehand one whole run on each counts the greedy tokens both give alike. A change that rounds
differently flips a few of W1's random-weight argmaxes (the lengths, and so the work, stay the same:
``ignore_eos``); a build that packs weights differently from the working tree's (the engine packs them
once, with the working tree's kernels) computes garbage, and almost no token agrees: then the timings
mean nothing. Since 441b09b the value pool is head-major; a base before it lays values out token-major
and is refused (its kernels would read the working tree's pools as garbage).

    python benchmarks/kernel_ab.py --base HEAD~3 [--model-preset w1-llama|qwen2-0.5b] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from pagellm import LLM, SamplingParams
from pagellm.bench.step_log import StepLog
from pagellm.bench.workloads import MODEL_PRESETS, bench_model_path, random_workload
from pagellm.kernels import native

SOURCE = "pagellm/kernels/cpu_kernels.c"
HEAD_MAJOR_VALUES = "values [num_blocks, num_kv_heads, block_size, head_dim]"  # the layout line of its header


def build(source: Path) -> Any:
    """The kernels compiled from ``source`` (cached by content, like the working tree's)."""
    native.SOURCE = source
    native.load.cache_clear()
    lib = native.load()
    if lib is None:
        raise SystemExit(f"the kernels in {source} did not build (see the warning above)")
    return lib


def use(lib: Any) -> None:
    native.load = lambda: lib


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="git revision (or C file) whose kernels to compare against")
    p.add_argument("--model-preset", default="w1-llama", choices=sorted(MODEL_PRESETS))
    p.add_argument("--repeats", type=int, default=3, help="W1 runs, each with both builds taking turns")
    args = p.parse_args()
    root = Path(__file__).resolve().parent.parent
    working, load = native.SOURCE, native.load
    with tempfile.TemporaryDirectory() as tmp:
        base_src = Path(args.base)
        if not base_src.is_file():
            base_src = Path(tmp) / "cpu_kernels.c"
            base_src.write_text(subprocess.run(["git", "show", f"{args.base}:{SOURCE}"], cwd=root, check=True,
                                               capture_output=True, text=True).stdout)
        if HEAD_MAJOR_VALUES not in base_src.read_text():
            raise SystemExit(f"{args.base}'s kernels lay the value pool out token-major (before 441b09b); the "
                             f"engine's pools are head-major now: compare against 441b09b or later")
        libs = {"base": build(base_src), "working tree": build(working)}
    path = bench_model_path(args.model_preset, "bfloat16")
    llm = LLM(str(path), dtype="bfloat16", max_model_len=800)
    engine = llm.llm_engine
    w = random_workload(64, (64, 512), (32, 256), engine.vocab_size)
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in w.output_lens]
    llm.generate(w.prompts[:2], [sp.clone(max_tokens=4) for sp in params[:2]], use_tqdm=False)  # warm-up
    names = list(libs)
    # kind -> (base - working tree) / base of each pair of steps
    diffs: dict[str, list[float]] = {"prompt": [], "decode": []}
    try:
        tokens = {}
        for name in names:
            use(libs[name])
            llm.reset_prefix_cache()
            tokens[name] = [o.outputs[0].token_ids for o in llm.generate(w.prompts, params, use_tqdm=False)]
        alike = sum(a == b for x, y in zip(tokens["base"], tokens["working tree"]) for a, b in zip(x, y))
        print(f"greedy tokens alike with both builds: {alike} of {w.output_tokens}")
        for repeat in range(args.repeats):
            llm.reset_prefix_cache()
            for i, (prompt, sp) in enumerate(zip(w.prompts, params)):
                engine.add_request(f"ab{repeat}-{i}", {"prompt_token_ids": prompt}, sp)
            step, pending = 0, {}
            log = StepLog.install(engine)
            while engine.has_unfinished_requests():
                name = names[(step + step // 2) % 2]  # A B B A A B B A ...
                use(libs[name])
                logged = len(log.records)
                engine.step()
                step += 1
                if len(log.records) == logged:
                    continue  # nothing ran
                record = log.records[-1]  # the model's time in the step, without the engine's
                kind, took = ("prompt" if record.num_prefill_tokens else "decode"), record.seconds
                size = record.num_prefill_tokens + record.num_decode_seqs
                # Paired with the last unpaired step of its kind if that ran on the other build and
                # had about as many tokens (a chunked prompt's last, short step pairs with nothing).
                other = pending.pop(kind, None)
                if other is not None and other[0] != name and abs(other[2] - size) <= 0.1 * size:
                    base, work = (other[1], took) if other[0] == "base" else (took, other[1])
                    diffs[kind].append((base - work) / base)
                else:
                    pending[kind] = (name, took, size)
            counts = ", ".join(f"{len(d)} {kind}-step pairs" for kind, d in diffs.items())
            print(f"run {repeat + 1} of {args.repeats}: {counts} so far", flush=True)
    finally:
        native.load = load
        for observer in list(engine.step_observers):
            engine.step_observers.remove(observer)
    for kind, d in diffs.items():
        if d:
            print(f"{kind} steps, {len(d)} pairs: the working tree's {statistics.median(d) * 100:+.1f}% shorter than "
                  f"the base's (median; mean {statistics.mean(d) * 100:+.1f}%; shorter in {sum(x > 0 for x in d)} of "
                  f"{len(d)} pairs)")


if __name__ == "__main__":
    main()
