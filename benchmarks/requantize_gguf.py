"""Write other quantizations of a GGUF file with llama.cpp's own quantizer (llama-cpp-python, the
optional ``llama`` extra), for the benchmarks of each quant type on the same model.

    python benchmarks/requantize_gguf.py SmolLM2-135M-Instruct.Q4_1.gguf Q8_0 Q4_K_M --out-dir /tmp/gguf

Requantizing starts from the file's own (already quantized) weights: the results have its accuracy
at best, and the speed of the new type, which is what the latency and throughput benchmarks compare.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

FTYPES = {"Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "Q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",
          "Q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0", "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
          "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", type=Path)
    parser.add_argument("types", nargs="+", choices=sorted(FTYPES))
    parser.add_argument("--out-dir", type=Path, default=Path("."))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print("llama-cpp-python is missing: pip install 'pagellm[llama]' (make install-llama)", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.gguf.stem.rsplit(".", 1)[0]
    for name in args.types:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, FTYPES[name])
        params.allow_requantize = True
        params.nthread = args.threads
        out = args.out_dir / f"{stem}.{name}.gguf"
        status = llama_cpp.llama_model_quantize(str(args.gguf).encode(), str(out).encode(), params)
        if status != 0:
            print(f"{name}: llama.cpp's quantizer failed ({status})", file=sys.stderr)
            return 1
        print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
