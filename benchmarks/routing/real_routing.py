"""Routing chat prompts on real weights: the router as the surgery trains it, reading the merge's
final state or its token embeddings, with prompt prefixes counted from the first token (before) and
after the chat template every prompt shares (now).

On the SmolLM2-135M family of ``benchmarks/real_weights/real_family.py`` (its work folder), the task-arithmetic
merge's states are captured once at both places a router reads: the final norm's output (a surgery
without block adapters) and the first block's input, the token embeddings (``depth: all``; issue 33,
item 6). For each: the surgery's split of the 50 calibration chats per domain (``held_out`` 0.2, seed
0), ``train_router`` as the surgery calls it, then the share of 100 unseen test prompts per domain
routed to their own domain (the user turn cut to 16 / 32 / 64 tokens, and whole, inside SmolLM2's
chat template with its default system prompt), the share of 60 everyday requests
(``benchmarks/data/general_instructions.jsonl``) and of swapped domains sent to ``none``.

Usage: python benchmarks/routing/real_routing.py --workdir WORK [--out PATH] [--overwrite]
"""

import argparse
import os
import sys
from typing import Dict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import add_output_options, machine_info, write_json  # noqa: E402
from real_family import chat_prompt  # noqa: E402
from real_table import DOMAINS, ROUTE_TOKENS, everyday_requests, load_splits  # noqa: E402
from router_states import HELD_OUT, SEED, merged_prompt_states  # noqa: E402


def measure(workdir: str) -> Dict[str, dict]:
    import mergekit_darts.repair.route.train as router_train
    from mergekit_darts.repair.route.prefix import pooled_at
    from mergekit_darts.repair.train.split import split_held_out
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(workdir, "base"))
    splits = load_splits(workdir)

    def cut(prompt: str, tokens) -> str:
        return prompt if tokens is None else tokenizer.decode(tokenizer(prompt, add_special_tokens=False)["input_ids"][:tokens])

    lengths = {"whole" if n is None else str(n): n for n in (*ROUTE_TOKENS, None)}
    groups = {f"calib_{d}": [example["chat"] for example in splits[d]["calib"]] for d in DOMAINS}
    groups.update({f"test_{d}_{label}": [chat_prompt(tokenizer, cut(ex["prompt"], n)) for ex in splits[d]["test"]]
                   for d in DOMAINS for label, n in lengths.items()})
    groups["everyday"] = [chat_prompt(tokenizer, text) for text in everyday_requests()]
    captured = merged_prompt_states(os.path.join(workdir, "merge_ta"), groups, max_positions=256, batch_size=10,
                                    cache_dir=os.path.join(workdir, "capture_cache"), add_special_tokens=False)
    results = {}
    for where, states in captured.items():
        calibration = {d: states[f"calib_{d}"] for d in DOMAINS}
        held = {d: split_held_out(calibration[d].records, HELD_OUT, SEED) for d in DOMAINS}
        for variant, forced in (("before", 0), ("now", None)):
            original = router_train.shared_prefix_length
            if forced is not None:  # prefixes counted from the first token, as before
                router_train.shared_prefix_length = lambda states: forced
            try:
                router, entry = router_train.train_router(calibration, held, seed=SEED)
            finally:
                router_train.shared_prefix_length = original

            def routed(name):
                return router.route(pooled_at(states[name], (None,))["all"])

            own = {label: {d: float((routed(f"test_{d}_{label}") == i).float().mean()) for i, d in enumerate(DOMAINS)}
                   for label in lengths}
            results[f"{where}, {variant}"] = {
                "reads": "the merge's final state" if where == "final" else "the token embeddings (depth: all)",
                "prefixes": "from the first token" if forced is not None else "after the shared template",
                "shared_prefix_tokens": entry["calibration"]["shared_prefix_tokens"], "kind": router.kind,
                "threshold": round(router.threshold, 4), "own_domain": own,
                "everyday_to_none": round(float((routed("everyday") == -1).float().mean()), 3),
                "swapped_domains_to_none": round(entry["out_of_domain"]["none_share"], 3)}
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    add_output_options(parser)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    results = measure(args.workdir)
    for variant, figures in results.items():
        print(f"{variant} ({figures['kind']}, t={figures['threshold']}): everyday -> none {figures['everyday_to_none']:.0%}, swapped domains -> none "
              f"{figures['swapped_domains_to_none']:.0%}, own domain {figures['own_domain']}")
    write_json("real_routing", {"machine": machine_info(), "workdir": args.workdir, "results": results},
               args.out, args.overwrite)


if __name__ == "__main__":
    main()
