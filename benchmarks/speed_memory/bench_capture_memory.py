"""Capture memory and speed: peak resident memory as a multiple of one model's weights, and the
capture forward's throughput against a plain ``model(...)`` forward over the same tokens, in one run.

``capture_domains`` loads the merged model, then each expert, one at a time. This measures how
close it comes to "one model in memory": every measurement runs in a fresh Python subprocess that
reports its own peak RSS (``VmHWM`` from /proc/self/status: the kernel's high-water mark, so no
polling gaps; not ``ru_maxrss``, which on Linux inherits the parent's RSS across fork+exec).
Modes, interleaved and repeated:

* ``baseline``: the interpreter with torch, transformers and mergekit_darts.repair.capture.domains imported and
                one forward of a 32-wide Llama run (every mode does this first);
* ``load``:     baseline + ``from_pretrained`` of the merged model + one forward of one capture batch
                (the floor: what holding one model and running one batch costs);
* ``entropy``:  baseline + one ``token_entropy`` call on [batch, max_positions, H] states with
                a [vocab, H] head: its transient peak (VmHWM reset via /proc/self/clear_refs), to
                explain what capture adds over ``load``;
* ``capture``:  baseline + ``capture_domains`` for the merged model and three experts, three domains,
                with a fresh, empty cache directory (so every model really is loaded and run);
* ``speed``:    one expert loaded once; interleaved timings (CPU clock) of a plain ``model(...)`` forward
                (logits included, what lm-eval or a user runs) and of the capture's own passes
                (``forward_hidden``: the expert's states + entropies, the merged model's states) over
                the same padded batches of the same calibration ids.

Figures (W = bytes of one model's weight tensors as stored in its safetensors, here float32, which
is also the capture dtype; C = bytes of the tensors the CaptureResult holds at the end: hidden
states, entropies, ids, masks and LM heads):

* capture ratio       = (peak_capture - peak_baseline - C) / W      target <= 1.15
* capture ratio incl. cached tensors = (peak_capture - peak_baseline) / W
* load ratio          = (peak_load - peak_baseline) / W             (reference: one model + one forward)
* throughput ratio    = plain forward seconds / capture pass seconds  target >= 0.9 (expert pass)

    python benchmarks/speed_memory/bench_capture_memory.py                       # ~3-5 min on 2 cores
    python benchmarks/speed_memory/bench_capture_memory.py --hidden 2048 --layers 8 --vocab 32000 --intermediate 4096
"""

import argparse
import json
import os
import random
import resource
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import add_output_options, log, machine_info, median, print_table, run_json_child, write_json  # noqa: E402

DOMAINS = ("math", "code", "chat")
MODES = ("baseline", "load", "capture", "entropy", "speed")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--intermediate", type=int, default=None, help="MLP size (default: the tiny models' own)")
    p.add_argument("--speed-repeats", type=int, default=5, help="interleaved timing rounds of the speed mode")
    p.add_argument("--samples", type=int, default=16, help="calibration texts per domain")
    p.add_argument("--max-positions", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8, help="capture batch size")
    p.add_argument("--repeats", type=int, default=2, help="fresh subprocesses per mode")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workdir", default=None, help="where to build the models (default: a temp dir)")
    add_output_options(p)
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--family", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------- child side

def peak_rss_bytes() -> int:
    """This process's peak RSS: VmHWM of /proc/self/status (the high-water mark of the address
    space made at exec). Not ru_maxrss: Linux carries the parent's RSS over fork+exec into it."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # fallback (non-Linux: may include the parent)


def calibration_texts(domain: str, samples: int, max_words: int):
    from mergekit_darts.tiny import DEFAULT_WORDS

    rng = random.Random(f"{domain}-calibration")
    return [" ".join(rng.choice(DEFAULT_WORDS) for _ in range(rng.randint(max_words // 2, max_words)))
            for _ in range(samples)]


def current_rss_bytes() -> int:
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmRSS:"))


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as handle:  # "5": reset VmHWM to the current RSS
        handle.write("5")


def tensor_bytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def warm_up_runtime() -> None:
    """Run every mode's fixed costs (Llama modeling code, tokenizers, safetensors, one forward of a
    32-wide model) so the baseline holds all of the runtime and the differences are about the model."""
    import safetensors.torch  # noqa: F401
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM  # noqa: F401

    from mergekit_darts.tiny import tiny_config

    tiny = LlamaForCausalLM(tiny_config()).eval()
    with torch.no_grad():
        tiny(input_ids=torch.ones(2, 8, dtype=torch.long))


def child(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401
    from transformers.utils import logging as hf_logging

    from mergekit_darts.repair.capture.context import CaptureContext
    from mergekit_darts.repair.capture.domains import DomainCaptureSpec, capture_domains

    hf_logging.set_verbosity_error()
    warm_up_runtime()
    family = json.loads(args.family)
    result = {"mode": args.child}
    if args.child == "load":
        from transformers import AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(family["merged"], dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(family["merged"])
        texts = calibration_texts("math", args.batch_size, args.max_positions - 2)
        batch = tokenizer(texts, padding=True, truncation=True, max_length=args.max_positions, return_tensors="pt")
        with torch.no_grad():
            model.model(**batch)
    elif args.child == "entropy":
        # the transient of one token_entropy call at capture's batch shape (what capture adds over "load")
        from mergekit_darts.repair.capture.entropy import token_entropy

        states = torch.randn(args.batch_size, args.max_positions, args.hidden)
        head = torch.randn(args.vocab, args.hidden)
        before = current_rss_bytes()
        reset_peak_rss()
        token_entropy(states, head)
        result["entropy_transient_bytes"] = peak_rss_bytes() - before
    elif args.child == "capture":
        specs = [DomainCaptureSpec(name=d, expert=family[d], texts=calibration_texts(d, args.samples, args.max_positions - 2))
                 for d in DOMAINS]
        with tempfile.TemporaryDirectory() as cache:
            ctx = CaptureContext.open(family["merged"], args.max_positions, dtype="float32", device="cpu",
                                      batch_size=args.batch_size, cache_dir=cache, progress=False)
            captured = capture_domains(ctx, specs)
        cached = tensor_bytes(captured.merged_head)
        for data in captured.domains.values():
            for name in ("input_ids", "attention_mask", "position_ids", "merged_hidden", "expert_hidden",
                         "expert_entropy", "expert_head"):
                cached += tensor_bytes(getattr(data, name))
        result["cached_bytes"] = cached
        result["hidden_shapes"] = {d: list(c.merged_hidden.shape) for d, c in captured.domains.items()}
    elif args.child == "speed":
        result.update(speed(args, family))
    result["peak_rss_bytes"] = peak_rss_bytes()
    return result


def speed(args, family) -> dict:
    """CPU seconds of a plain model(...) forward and of the capture passes over the same batches."""
    import torch

    from _common import interleaved
    from mergekit_darts.repair.capture.context import CaptureContext
    from mergekit_darts.repair.capture.domains import DomainCaptureSpec
    from mergekit_darts.repair.capture.forward import forward_hidden, pad_rows
    from mergekit_darts.repair.capture.prompts import tokenize_prompts

    ctx = CaptureContext.open(family["merged"], args.max_positions, dtype="float32", device="cpu",
                              batch_size=args.batch_size, progress=False)
    spec = DomainCaptureSpec(name="math", expert=family["math"], texts=calibration_texts("math", args.samples, args.max_positions - 2))
    ids = tokenize_prompts(ctx.tokenizer, spec, args.max_positions).ids
    model = ctx.slot(family["math"]).get()
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # the capture's own batching
    batches = []
    for start in range(0, len(order), args.batch_size):
        input_ids, mask = pad_rows([ids[i] for i in order[start:start + args.batch_size]], ctx.pad_id)
        batches.append((input_ids, mask.long(), torch.arange(input_ids.shape[1]).expand_as(input_ids)))

    @torch.no_grad()
    def plain():
        for input_ids, mask, positions in batches:
            model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=False)

    variants = {"plain_forward": plain,
                "capture_expert": lambda: forward_hidden(model, ids, ctx, "expert", with_entropy=True),
                "capture_merged": lambda: forward_hidden(model, ids, ctx, "merged", with_entropy=False)}
    plain()  # warm-up
    times = interleaved(variants, args.speed_repeats, clock="cpu")
    return {"tokens": sum(len(row) for row in ids), "seconds": times}


# ---------------------------------------------------------------------------------- parent side

def build_family(root: str, args) -> dict:
    """A random "merged" model and three experts (merged + seeded deltas); all float32 safetensors."""
    from mergekit_darts.tiny import make_expert, make_random_model

    family = {"merged": os.path.join(root, "merged")}
    sizes = {"intermediate_size": args.intermediate} if args.intermediate else {}
    make_random_model(family["merged"], hidden_size=args.hidden, layers=args.layers, vocab_size=args.vocab,
                      max_position_embeddings=max(256, args.max_positions), **sizes)
    for index, domain in enumerate(DOMAINS):
        family[domain] = os.path.join(root, domain)
        make_expert(family["merged"], family[domain], seed=index + 1, scale=0.05)
    return family


def weight_bytes(model_dir: str) -> int:
    from mergekit_darts.output.layout import safetensors_header

    total = 0
    for name in os.listdir(model_dir):
        if name.endswith(".safetensors"):
            header = safetensors_header(os.path.join(model_dir, name))
            total += sum(end - start for start, end in (i["data_offsets"] for i in header.values()))
    return total


def run_child(mode: str, family: dict, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--family", json.dumps(family),
           "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--samples", str(args.samples), "--max-positions", str(args.max_positions),
           "--batch-size", str(args.batch_size), "--threads", str(args.threads),
           "--speed-repeats", str(args.speed_repeats)]
    return run_json_child(cmd, mode)


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    with tempfile.TemporaryDirectory(dir=args.workdir) as root:
        log(f"building merged model + 3 experts: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}")
        family = build_family(root, args)
        w = weight_bytes(family["merged"])
        log(f"one model's weights: {w / 2**20:.1f} MiB")
        runs = {mode: [] for mode in MODES}
        for round_index in range(args.repeats):
            order = MODES if round_index % 2 == 0 else MODES[::-1]
            for mode in order:
                log(f"round {round_index + 1}/{args.repeats}: {mode}")
                runs[mode].append(run_child(mode, family, args))

    entropy_transient = median([r["entropy_transient_bytes"] for r in runs.pop("entropy")])
    speed_runs = runs.pop("speed")
    seconds = {name: [t for r in speed_runs for t in r["seconds"][name]] for name in speed_runs[0]["seconds"]}
    medians = {name: median(values) for name, values in seconds.items()}
    throughput = {"tokens": speed_runs[0]["tokens"], "median_cpu_s": medians,
                  "expert_pass_vs_plain_forward": medians["plain_forward"] / medians["capture_expert"],
                  "merged_pass_vs_plain_forward": medians["plain_forward"] / medians["capture_merged"]}
    peak = {mode: median([r["peak_rss_bytes"] for r in rs]) for mode, rs in runs.items()}
    cached = median([r["cached_bytes"] for r in runs["capture"]])
    base = peak["baseline"]
    ratios = {
        "capture_excl_cached": (peak["capture"] - base - cached) / w,
        "capture_incl_cached": (peak["capture"] - base) / w,
        "load_one_model": (peak["load"] - base) / w,
    }
    mib = lambda b: b / 2**20  # noqa: E731
    print_table(
        f"Capture peak RSS: merged + 3 experts, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
        f"float32, 3 domains x {args.samples} texts, max_positions {args.max_positions}, batch {args.batch_size} "
        f"(median of {args.repeats} fresh processes per mode)",
        ["quantity", "MiB", "/ W"],
        [
            ["W: one model's weight bytes", mib(w), 1.0],
            ["baseline peak RSS (python+torch+transformers)", mib(base), base / w],
            ["load: peak RSS", mib(peak["load"]), peak["load"] / w],
            ["capture: peak RSS", mib(peak["capture"]), peak["capture"] / w],
            ["C: cached tensors held by CaptureResult", mib(cached), cached / w],
            ["(load - baseline) / W", "", ratios["load_one_model"]],
            ["(capture - baseline) / W", "", ratios["capture_incl_cached"]],
            ["(capture - baseline - C) / W   [target <= 1.15]", "", ratios["capture_excl_cached"]],
            ["E: one token_entropy call's transient (batch x T x vocab)", mib(entropy_transient), entropy_transient / w],
            ["(capture - load - C) / W: capture's excess over one model", "",
             (peak["capture"] - peak["load"] - cached) / w],
        ],
    )
    print_table(f"Capture throughput vs a plain model(...) forward over the same {throughput['tokens']} tokens "
                f"(CPU seconds, median of {len(seconds['plain_forward'])} interleaved rounds)",
                ["pass", "CPU s", "throughput / plain forward"],
                [["plain model(...) forward (logits)", medians["plain_forward"], 1.0],
                 ["capture: expert states + entropies  [target >= 0.9]", medians["capture_expert"],
                  throughput["expert_pass_vs_plain_forward"]],
                 ["capture: merged states", medians["capture_merged"], throughput["merged_pass_vs_plain_forward"]]])
    write_json("bench_capture_memory", {
        "benchmark": "capture_memory",
        "target": "(peak_capture - peak_baseline - cached) / weight_bytes <= 1.15; expert pass throughput >= 0.9x plain",
        "settings": {k: v for k, v in vars(args).items() if k not in ("child", "family")},
        "machine": machine_info(), "weight_bytes": w, "cached_bytes": cached, "peak_rss_bytes": peak,
        "entropy_transient_bytes": entropy_transient,
        "ratios": ratios, "throughput": throughput, "runs": runs, "speed_runs": speed_runs,
    }, args.out, overwrite=args.overwrite)


if __name__ == "__main__":
    main()
