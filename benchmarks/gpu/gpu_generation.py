"""Compiled static-cache generation on a GPU with CUDA graphs: Darts (one domain, mixed rows, auto) vs the plain merge.

``bench_generation_compiled.py`` with GPU defaults: ``--device cuda --dtype bfloat16 --mode
reduce-overhead`` (transformers' default compile mode for generation: CUDA graphs), wall clock, a random
Llama of hidden 2048 and 8 layers, 128 new tokens, batch 1 and 8, 10 interleaved rounds. Writes
``results/gpu_generation.json`` (a time-stamped file next to it if that exists). Options given on the
command line win over these defaults; every option of bench_generation_compiled.py is accepted.

What to look for: ``graph_breaks`` 0, ``graphs_compiled_while_timing`` 0 (no recompiles), the compiled
tokens equal to the eager ones (bf16 kernels may differ in rare near-ties), and the ratios
tokens/s(one|mixed|auto) / tokens/s(plain) against the 0.98 target.

    python benchmarks/gpu/gpu_generation.py                                   # CUDA (a few minutes)
    python benchmarks/gpu/gpu_generation.py --hidden 4096 --layers 32         # a Llama-2-7B-shaped random model
    python benchmarks/gpu/gpu_generation.py --device cpu --dtype float32 --mode default --backend aot_eager \\
        --hidden 64 --layers 2 --vocab 512 --new-tokens 4 --repeats 1 --batch 1 --out /tmp/check.json
                                                                          # checks that the script runs
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
import _common  # noqa: E402,F401  (puts speed_memory/ on sys.path)
from bench_generation_compiled import main  # noqa: E402

GPU_DEFAULTS = ["--device", "cuda", "--dtype", "bfloat16", "--mode", "reduce-overhead", "--clock", "wall",
                "--hidden", "2048", "--layers", "8", "--new-tokens", "128", "--repeats", "10", "--threads", "0"]

if __name__ == "__main__":
    main(GPU_DEFAULTS + sys.argv[1:], name="gpu_generation")  # argparse: the last value of an option wins
