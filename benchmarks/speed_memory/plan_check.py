"""How far ``mergekit-darts plan``'s estimate is from what a run measures, on this CPU (docs/scale.md
"Before the run: plan"): a random Llama family big enough that matmuls dominate (hidden 256, 8 layers by
default), merged and repaired through ``mergekit-yaml``'s path, each stage's wall seconds and the peak
RSS beside the plan's seconds (``--gpu cpu``) and bytes for the same YAML. Every calibration record is
long enough to fill ``max_positions``, so the plan's token count is the run's.

    python benchmarks/speed_memory/plan_check.py [--hidden 256 --layers 8 --steps 30] [--out FILE]
"""

import argparse
import os
import sys
import tempfile
import time
from typing import List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import add_output_options, log, machine_info, print_table, write_json  # noqa: E402

SURGERIES = {  # what each row trains: the paper's final-state loss, and the preset's shape of training
    "ewl1": "  loss: ewl1\n  rank: 16",
    "preset_shape": "  loss: kl\n  rank: 16\n  depth: all\n  depth_rank: 8\n  adapter_init: delta",
}


def family(root: str, hidden: int, layers: int):
    from mergekit_darts.tiny import build_tokenizer, make_expert, make_random_model

    words = [f"w{i}" for i in range(2000)]
    tokenizer = build_tokenizer(words)
    base = os.path.join(root, "base")
    make_random_model(base, tokenizer=tokenizer, hidden_size=hidden, layers=layers, max_position_embeddings=512)
    experts = {}
    for index, domain in enumerate(("math", "code")):
        experts[domain] = os.path.join(root, domain)
        make_expert(base, experts[domain], seed=index + 1, scale=0.3)
    return base, experts, words


def config_text(base: str, experts: dict, words, surgery: str, steps: int, samples: int, tokens: int) -> str:
    import random

    rng = random.Random(0)
    lines = ["merge_method: task_arithmetic", f"base_model: {base}", "models:"]
    for path in experts.values():
        lines += [f"  - model: {path}", "    parameters: {weight: 0.5}"]
    lines += ["dtype: float32", "surgery:", surgery, f"  steps: {steps}", f"  max_positions: {tokens}",
              "  device: cpu", "  dtype: float32", "  seed: 0", "  no_regret: false", "  router: false", "  domains:"]
    for domain, path in experts.items():
        # longer than max_positions: every record is cut to exactly `tokens` positions
        texts = [" ".join(rng.choice(words) for _ in range(2 * tokens)) for _ in range(samples)]
        lines += [f"    {domain}:", f"      model: {path}",
                  f"      calibration: {{texts: {texts!r}, samples: {samples}}}"]
    return "\n".join(lines) + "\n"


def measure(config: str, out: str) -> dict:
    from mergekit.options import MergeOptions

    from mergekit_darts.hook import original_run_merge
    from mergekit_darts.pipeline import merge_and_repair

    from mergekit_darts.repair.stages import peak_rss_gib

    before, started = peak_rss_gib(), time.perf_counter()
    report = merge_and_repair(config, out, original_run_merge(), options=MergeOptions(quiet=True))
    return {"wall": time.perf_counter() - started, "stages": report["stages"], "rss_before_gib": before}


def saved_activations(shapes=((256, 688, 4, 4), (576, 1536, 9, 3), (1024, 2816, 16, 4)), rank: int = 8,
                      positions: int = 512) -> List[dict]:
    """Float32 values autograd keeps per position for one of transformers' Llama blocks with a rank-r adapter
    on every linear (frozen weights and the adapters themselves not counted: they are not activations),
    beside the plan's ``ACTIVATION_VECTORS`` model of the same block."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from mergekit_darts.plan import ACTIVATION_VECTORS

    rows = []
    for hidden, intermediate, heads, kv_heads in shapes:
        config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                             num_key_value_heads=kv_heads, num_hidden_layers=1)
        config._attn_implementation = "sdpa"  # what from_pretrained picks; eager also keeps heads x positions
        layer = LlamaDecoderLayer(config, 0).requires_grad_(False)
        adapters = []
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear):
                down = torch.nn.Parameter(torch.randn(rank, module.in_features) * 0.01)
                up = torch.nn.Parameter(torch.zeros(module.out_features, rank))
                adapters += [down, up]
                module.register_forward_hook(lambda m, i, o, a=down, b=up: o + (i[0] @ a.T) @ b.T)
        x = torch.randn(1, positions, hidden)
        position_ids = torch.arange(positions)[None]
        embeddings = LlamaRotaryEmbedding(config)(x, position_ids)
        seen = {t.data_ptr() for t in [*layer.parameters(), *adapters]}
        saved = [0]

        def pack(tensor):
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                saved[0] += tensor.numel()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            layer(x, position_ids=position_ids, position_embeddings=embeddings)
        planned = ACTIVATION_VECTORS[0] * intermediate + ACTIVATION_VECTORS[1] * hidden
        rows.append({"hidden": hidden, "intermediate": intermediate, "heads": heads, "kv_heads": kv_heads,
                     "saved_per_position": saved[0] / positions, "planned_per_position": planned,
                     "measured_over_planned": saved[0] / positions / planned})
    return rows


def predicted(config: str, tokens: int) -> dict:
    from mergekit_darts.cli.plan import plan_report

    report = plan_report(config, "cpu", tokens)
    return {"merge": report["merge_seconds"],
            "domains": {name: {"capture": d["capture"]["seconds"],
                               "train": d["delta start"]["seconds"] + d["training"]["seconds"],
                               "train_bytes": d["training"]["bytes"], "capture_bytes": d["capture"]["bytes"]}
                        for name, d in report["domains"].items()}}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default=",".join(SURGERIES))
    add_output_options(parser)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    result = {"machine": machine_info(), "shape": {"hidden": args.hidden, "layers": args.layers},
              "steps": args.steps, "samples": args.samples, "tokens": args.tokens, "rows": {}}
    table = []
    with tempfile.TemporaryDirectory() as root:
        base, experts, words = family(root, args.hidden, args.layers)
        for row in args.rows.split(","):
            config = config_text(base, experts, words, SURGERIES[row], args.steps, args.samples, args.tokens)
            plan = predicted(config, args.tokens)
            log(f"{row}: running the merge and surgery")
            run = measure(config, os.path.join(root, f"out_{row}"))
            stages = run["stages"]
            capture = sum(d["capture"] for d in plan["domains"].values())
            rows = {"capture": (capture, stages["capture"]["seconds"])}
            for name, d in plan["domains"].items():
                rows[f"train {name}"] = (d["train"], stages[f"train:{name}"]["seconds"])
            # the peak the run added to the process (torch itself is there before it: on a GPU, the CUDA context)
            peak = max(s.get("peak_rss_gib_so_far", 0) for s in stages.values()) - run["rss_before_gib"]
            rows["peak memory added (bytes)"] = (max(d["train_bytes"] + d["capture_bytes"]
                                                     for d in plan["domains"].values()), peak * 2 ** 30)
            result["rows"][row] = {k: {"planned": p, "measured": m, "measured_over_planned": m / p if p else None}
                                   for k, (p, m) in rows.items()}
            table += [[row, k, f"{p:.3g}", f"{m:.3g}", f"{m / p:.2f}" if p else "-"] for k, (p, m) in rows.items()]
    result["activations_per_block"] = saved_activations()
    table_act = [[f"{r['hidden']} / {r['intermediate']} / {r['heads']}:{r['kv_heads']}", f"{r['saved_per_position']:.0f}",
                  f"{r['planned_per_position']:.0f}", f"{r['measured_over_planned']:.2f}"]
                 for r in result["activations_per_block"]]
    print_table("float32 values autograd keeps per position in one Llama block (rank-8 adapters)",
                ["hidden / MLP / heads", "saved", "planned", "saved / planned"], table_act)
    print_table("plan (--gpu cpu) against a measured run", ["surgery", "stage", "planned", "measured", "measured / planned"],
                table)
    write_json("plan_check", result, args.out, args.overwrite)


if __name__ == "__main__":
    main()
