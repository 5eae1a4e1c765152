"""Routing chat prompts on real weights: the router as the surgery trains it, with prompt prefixes
counted from the first token (before) and after the chat template every prompt shares (now).

On the SmolLM2-135M family of ``benchmarks/real_family.py`` (its work folder), the router of a
``depth: all`` surgery reads the merged model's token embeddings (the first adapted block's input), so
its training states are those embeddings: no model is run. For each variant: the surgery's split of
the 50 calibration chats per domain (``held_out`` 0.2, seed 0), ``train_router`` as the surgery calls
it, then the share of 100 unseen test prompts per domain routed to their own domain (the user turn cut
to 16 / 32 / 64 tokens, and whole, inside SmolLM2's chat template with its default system prompt) and
the share of 60 everyday requests (``benchmarks/data/general_instructions.jsonl``) sent to ``none``.

Usage: python benchmarks/real_routing.py --workdir WORK [--out PATH] [--overwrite]
"""

import argparse
import glob
import json
import os
import sys
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import add_output_options, machine_info, write_json  # noqa: E402
from real_family import chat_prompt  # noqa: E402
from real_table import DOMAINS, ROUTE_TOKENS, everyday_requests, load_splits  # noqa: E402


def merged_embeddings(merge_dir: str) -> torch.Tensor:
    from safetensors import safe_open

    for path in sorted(glob.glob(os.path.join(merge_dir, "*.safetensors"))):
        with safe_open(path, "pt") as handle:
            if "model.embed_tokens.weight" in handle.keys():
                return handle.get_tensor("model.embed_tokens.weight").float()
    raise SystemExit(f"{merge_dir}: no model.embed_tokens.weight (run real_table.py's merge_ta row first)")


def measure(workdir: str) -> Dict[str, dict]:
    import mergekit_darts.repair.router_train as router_train
    from mergekit_darts.repair.router_prefix import PromptStates
    from mergekit_darts.repair.train.split import split_held_out
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(workdir, "base"))
    embeddings = merged_embeddings(os.path.join(workdir, "merge_ta"))
    splits = load_splits(workdir)
    everyday = everyday_requests()

    def ids(chat: str) -> List[int]:
        return tokenizer(chat, add_special_tokens=False)["input_ids"]

    def states(chats: List[str]) -> PromptStates:
        rows = [ids(chat) for chat in chats]
        hidden = torch.zeros(len(rows), max(map(len, rows)), embeddings.shape[1])
        for index, row in enumerate(rows):
            hidden[index, :len(row)] = embeddings[row]
        return PromptStates(hidden, torch.tensor([len(row) for row in rows]))

    def pooled(chats: List[str]) -> torch.Tensor:  # the shipped pooling of a whole prompt
        return torch.stack([torch.nn.functional.normalize(embeddings[ids(chat)].mean(0), dim=0) for chat in chats])

    def cut(prompt: str, tokens) -> str:
        return prompt if tokens is None else tokenizer.decode(ids(prompt)[:tokens])

    calibration = {d: states([example["chat"] for example in splits[d]["calib"]]) for d in DOMAINS}
    held = {d: split_held_out(calibration[d].records, 0.2, 0) for d in DOMAINS}
    results = {}
    for variant, forced in (("before: prefixes from the first token", 0), ("now: prefixes after the shared template", None)):
        original = router_train.shared_prefix_length
        if forced is not None:
            router_train.shared_prefix_length = lambda states: forced
        try:
            router, entry = router_train.train_router(calibration, held, seed=0)
        finally:
            router_train.shared_prefix_length = original
        own = {}
        for tokens in (*ROUTE_TOKENS, None):
            own["whole" if tokens is None else str(tokens)] = {
                d: float((router.route(pooled([chat_prompt(tokenizer, cut(ex["prompt"], tokens))
                                               for ex in splits[d]["test"]])) == i).float().mean())
                for i, d in enumerate(DOMAINS)}
        everyday_routes = router.route(pooled([chat_prompt(tokenizer, text) for text in everyday]))
        results[variant] = {
            "shared_prefix_tokens": entry["calibration"]["shared_prefix_tokens"], "kind": router.kind,
            "threshold": round(router.threshold, 4), "own_domain": own,
            "everyday_to_none": round(float((everyday_routes == -1).float().mean()), 3),
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
        print(f"{variant}: everyday -> none {figures['everyday_to_none']:.0%}, swapped domains -> none "
              f"{figures['swapped_domains_to_none']:.0%}, own domain {figures['own_domain']}")
    write_json("real_routing", {"machine": machine_info(), "workdir": args.workdir, "results": results},
               args.out, args.overwrite)


if __name__ == "__main__":
    main()
