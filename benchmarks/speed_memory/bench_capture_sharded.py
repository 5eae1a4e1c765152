"""Capture throughput on CPU: the plain single-device capture vs accelerate's device map with cpu/disk
offload, and the FLOP rate each reaches (the basis of docs/scale.md's 70B estimate).

A random Llama (default hidden 1024, 8 layers, vocab 32000) is saved as the merged model and as one
expert; ``capture_domains`` runs one domain of ``--samples`` x ``--tokens`` tokens through both (fresh
cache each time, so every model is loaded and run). Variants, interleaved and repeated:

* ``plain``:   one device (today's path)
* ``offload``: ``device_map: auto`` with ``max_memory: {cpu: half the model}``: the rest is on disk,
               read back layer by layer for every batch

Reported: wall seconds (load + forward), tokens/s, and the forward FLOP rate (2 x decoder weights per
token + the LM head on the expert's tokens for its entropies; attention's T^2 term is left out).

    python benchmarks/speed_memory/bench_capture_sharded.py          # ~2-4 min on 2 cores
"""

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import interleaved, log, machine_info, median, print_table, write_json  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from mergekit_darts.repair.capture.context import CaptureContext
    from mergekit_darts.repair.capture.domains import DomainCaptureSpec, capture_domains
    from mergekit_darts.tiny import DEFAULT_WORDS, build_tokenizer, make_random_model

    work = tempfile.mkdtemp(prefix="bench-capture-sharded-")
    tokenizer = build_tokenizer()
    merged, expert = os.path.join(work, "merged"), os.path.join(work, "expert")
    for path, seed in ((merged, 0), (expert, 1)):
        make_random_model(path, seed=seed, tokenizer=tokenizer, hidden_size=args.hidden, layers=args.layers,
                          vocab_size=args.vocab, max_position_embeddings=max(args.tokens, 256))
    model_bytes = sum(os.path.getsize(os.path.join(merged, f)) for f in os.listdir(merged) if f.endswith(".safetensors"))
    params = model_bytes // 4
    # FLOPs per token: the decoder's matmul weights (embedding lookup and the untied head excluded),
    # plus the head for the expert's entropy pass
    decoder_params = params - 2 * args.vocab * args.hidden
    words = [w for w in DEFAULT_WORDS if w.isalpha()]
    texts = [" ".join(words[(i + j) % len(words)] for j in range(args.tokens - 2)) for i in range(args.samples)]
    spec = [DomainCaptureSpec("bench", expert, texts)]
    counter = iter(range(10 ** 6))

    def capture(**kwargs):
        return lambda: capture_domains(CaptureContext.open(
            merged, args.tokens, device="cpu", dtype="float32", progress=False, batch_size=args.batch_size,
            cache_dir=os.path.join(work, f"c{next(counter)}"), **kwargs), spec)

    variants = {"plain": capture(), "offload": capture(device_map="auto", max_memory={"cpu": model_bytes // 2})}
    log(f"model: {params / 1e6:.1f} M params ({model_bytes / 2**20:.0f} MiB float32); capture of 2 models x "
        f"{args.samples} x {args.tokens} tokens")
    times = interleaved(variants, args.repeats)
    result = capture()()
    tokens = int(result.domains["bench"].attention_mask.sum()) * 2  # merged + expert
    flops = 2 * decoder_params * tokens + 2 * args.vocab * args.hidden * tokens // 2
    rows, out = [], {}
    for name, values in times.items():
        seconds = median(values)
        out[name] = {"seconds": values, "median_s": seconds, "tokens_per_s": tokens / seconds,
                     "forward_gflops": flops / seconds / 1e9}
        rows.append([name, f"{seconds:.2f}", f"{tokens / seconds:.0f}", f"{out[name]['forward_gflops']:.1f}"])
    print_table("capture on CPU (wall, load + forward, both models)", ["variant", "s", "tokens/s", "GFLOP/s"], rows)
    write_json("bench_capture_sharded", {"machine": machine_info(), "args": vars(args), "params": params, "decoder_params": decoder_params, "flops": flops,
                                         "model_bytes": model_bytes, "tokens": tokens, "variants": out}, args.out)


if __name__ == "__main__":
    main()
