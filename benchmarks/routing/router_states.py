"""Which merged state the router should read (issue 33, item 6): the token embeddings (the first
adapted block's input, what a ``depth: all`` surgery's router reads) against the plain merge's final
state (what a surgery without block adapters reads), on the demo family.

On a demo work folder (``bench_quality.py --prepare``: ``merged/``, ``calib_<domain>.jsonl``,
``data/<domain>_test.jsonl``) the merged model's prompt states are captured once at both places
(``capture_merged_prompts`` with ``depth`` = every layer); the router is trained on the 50
calibration prompts per domain as the pipeline trains it (the surgery's 20 % held-out split, seed 0,
prefixes, classifier chosen in cross-validation, conformal gate at 5 %), and measured on the 100
unseen test prompts per domain cut to 16 / 32 / 64 tokens and whole (own domain, and ``none``), with
the swapped-domain fallback (a router fitted without a domain routes that domain's calibration
prompts). The demo's word-level vocabulary has no everyday requests, so swapped domains are the
out-of-domain side here; docs/routing.md has the real model's everyday requests.

Usage: python benchmarks/routing/router_states.py DEMO_DIR [--out PATH] [--overwrite]
"""

import argparse
import json
import os
import sys
from typing import Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import add_output_options, log, machine_info, write_json  # noqa: E402

DOMAINS = ("math", "code", "instruct")
HELD_OUT, SEED = 0.2, 0  # the surgery's default split and seed


def read_jsonl(path: str, field: str):
    with open(path) as handle:
        return [json.loads(line)[field] for line in handle if line.strip()]


def merged_prompt_states(merged: str, groups: Dict[str, List[str]], max_positions: int, batch_size: int,
                         cache_dir: Optional[str] = None, add_special_tokens: Optional[bool] = None) -> Dict[str, dict]:
    """{"final" | "embeddings": {group: PromptStates}}: the merged model's final states and its first
    block's input (the token embeddings) over each group of prompts, from one pass per group."""
    from transformers import AutoConfig

    from mergekit_darts.config import parse_surgery_block
    from mergekit_darts.pipeline import capture_context
    from mergekit_darts.repair.capture.domains import DomainCaptureSpec, capture_merged_prompts
    from mergekit_darts.repair.route.prefix import PromptStates
    from mergekit_darts.settings import RunSettings

    layers = AutoConfig.from_pretrained(merged).num_hidden_layers
    surgery = parse_surgery_block({  # only the capture settings matter: no surgery runs
        "max_positions": max_positions, "device": "cpu", "dtype": "float32", "seed": 0,
        "capture_batch_size": batch_size, "cache_dir": cache_dir,
        "domains": {"any": {"model": merged, "calibration": {"texts": ["unused"]}}}})
    ctx = capture_context(merged, surgery, RunSettings.resolve(surgery, progress=False))
    out = {"final": {}, "embeddings": {}}
    for name, texts in groups.items():
        data = capture_merged_prompts(ctx, DomainCaptureSpec(name=name, expert=merged, texts=texts,
                                                             add_special_tokens=add_special_tokens), depth=layers)
        out["final"][name] = PromptStates(data.merged_hidden, data.prompt_lengths)
        out["embeddings"][name] = PromptStates(data.block_inputs, data.prompt_lengths)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("demo_dir")
    add_output_options(parser)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    from router_families import measure, swapped

    from mergekit_darts.repair.route.train import train_router
    from mergekit_darts.repair.train.split import split_held_out

    groups = {}
    for d in DOMAINS:
        groups[f"calib_{d}"] = read_jsonl(os.path.join(args.demo_dir, f"calib_{d}.jsonl"), "prompt")[:50]
        groups[f"test_{d}"] = read_jsonl(os.path.join(args.demo_dir, "data", f"{d}_test.jsonl"), "prompt")
    states = merged_prompt_states(os.path.join(args.demo_dir, "merged"), groups, max_positions=128, batch_size=25)
    results = {}
    for where, by_group in states.items():
        calib = {d: by_group[f"calib_{d}"] for d in DOMAINS}
        test = {d: by_group[f"test_{d}"] for d in DOMAINS}
        held = {d: split_held_out(s.records, HELD_OUT, SEED) for d, s in calib.items()}
        router, entry = train_router(calib, held, seed=SEED)
        shares = swapped(lambda c, sp: train_router(c, sp, seed=SEED)[0], calib, held)
        results[where] = {"kind": router.kind, "threshold": router.threshold, "test": measure(router, test),
                          "swapped_none_share": shares,
                          "shared_prefix_tokens": entry["calibration"]["shared_prefix_tokens"]}
        cells = []
        for label, summary in results[where]["test"].items():
            own = "/".join(f"{100 * v:.0f}" for v in summary["accuracy"].values())
            none = "/".join(f"{100 * v:.0f}" for v in summary["none_share"].values())
            cells.append(f"{label}: own {own} none {none}")
        swapped_all = "/".join(f"{100 * shares[d]['all']:.0f}" for d in DOMAINS)
        log(f"{where} [{router.kind}, t={router.threshold:.4f}]: " + "; ".join(cells) + f"; swapped -> none {swapped_all}")
    write_json("router_states", {"machine": machine_info(), "demo_dir": args.demo_dir, "results": results},
               args.out, args.overwrite)


if __name__ == "__main__":
    main()
