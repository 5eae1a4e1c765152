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

Usage: python benchmarks/router_states.py DEMO_DIR [--out PATH] [--overwrite]
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import add_output_options, log, machine_info, write_json  # noqa: E402

DOMAINS = ("math", "code", "instruct")


def read_jsonl(path: str, field: str):
    with open(path) as handle:
        return [json.loads(line)[field] for line in handle if line.strip()]


def capture(demo_dir: str):
    """{"final": {domain: (calib, test)}, "embeddings": {...}} PromptStates of the merged model."""
    from transformers import AutoConfig

    from mergekit_darts.config import parse_surgery_block
    from mergekit_darts.pipeline import capture_context
    from mergekit_darts.repair.capture.domains import DomainCaptureSpec, capture_merged_prompts
    from mergekit_darts.repair.router_prefix import PromptStates
    from mergekit_darts.settings import RunSettings

    merged = os.path.join(demo_dir, "merged")
    layers = AutoConfig.from_pretrained(merged, trust_remote_code=True).num_hidden_layers
    texts = {d: {"calib": read_jsonl(os.path.join(demo_dir, f"calib_{d}.jsonl"), "prompt")[:50],
                 "test": read_jsonl(os.path.join(demo_dir, "data", f"{d}_test.jsonl"), "prompt")} for d in DOMAINS}
    surgery = parse_surgery_block({
        "max_positions": 128, "device": "cpu", "dtype": "float32", "seed": 0, "capture_batch_size": 25,
        "domains": {d: {"model": merged, "calibration": {"texts": texts[d]["calib"]}} for d in DOMAINS}})
    settings = RunSettings.resolve(surgery, progress=False)
    ctx = capture_context(merged, surgery, settings)
    out = {"final": {}, "embeddings": {}}
    for domain in DOMAINS:
        parts = {}
        for part in ("calib", "test"):
            data = capture_merged_prompts(ctx, DomainCaptureSpec(name=f"{part}_{domain}", expert=merged,
                                                                 texts=texts[domain][part]), depth=layers)
            parts[part] = {"final": PromptStates(data.merged_hidden, data.prompt_lengths),
                           "embeddings": PromptStates(data.block_inputs, data.prompt_lengths)}
        for where in out:
            out[where][domain] = (parts["calib"][where], parts["test"][where])
    return out, surgery, settings


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("demo_dir")
    add_output_options(parser)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    from router_families import measure, swapped

    from mergekit_darts.repair.router_train import train_router
    from mergekit_darts.repair.train.split import split_held_out

    states, surgery, settings = capture(args.demo_dir)
    results = {}
    for where, by_domain in states.items():
        calib = {d: s[0] for d, s in by_domain.items()}
        test = {d: s[1] for d, s in by_domain.items()}
        held = {d: split_held_out(s.records, surgery.held_out, settings.seed) for d, s in calib.items()}
        router, entry = train_router(calib, held, seed=settings.seed)
        shares = swapped(lambda c, sp: train_router(c, sp, seed=settings.seed)[0], calib, held)
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
