"""What each part of a data-free extract adds on the demo family (issue 33: norm and embedding deltas).

``mergekit-extract-lora --max-rank r`` writes a rank-r LoRA of every linear *and* the embeddings,
every norm and the LM head whole (``modules_to_save``). The shipped extract (``adapter_init: delta``,
``steps: 0``) has the block linears only. Here each part is applied to the plain merge's weights
directly, one domain at a time, and the domain's expert-written test set is scored with the demo's
scorer (100 problems per domain, greedy):

- ``blocks``: every block linear W_merge + the rank-r truncated SVD of (W_expert − W_merge) (exactly
  what the shipped extract's ``up · down`` adds; its scores are the ``extract_all8`` row's);
- ``+ norms``: the expert's RMSNorm weights (every block's two and the final one: 2·H per block + H);
- ``+ head``: the expert's LM head whole; ``+ head_lowrank``: the rank-r truncated SVD of the head's
  delta (what ``head_rank: r`` with ``adapter_init: delta`` starts from); ``+ embed`` / ``+ embed_lowrank``:
  the same for the embeddings;
- ``norms`` alone and ``all whole`` (blocks + norms + head + embeddings: what the real tool saves).

Sizes are counted as parameters per domain and as a share of a 7B shape (Llama-2-7B: 32 layers, H 4096,
MLP 11008, vocabulary 32000). Deterministic: no data, no training, no seed.

Usage: python benchmarks/demo_quality/extract_parts.py DEMO_DIR [--rank 8] [--out PATH] [--overwrite]
(DEMO_DIR as ``bench_quality.py --prepare`` makes it: ``family/``, ``merged/``, ``data/``)
"""

import argparse
import os
import sys
from typing import Dict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import add_output_options, log, machine_info, write_json  # noqa: E402

DOMAINS = ("math", "code", "instruct")
PARTS = ("blocks", "blocks+norms", "blocks+head_lowrank", "blocks+head", "blocks+embed_lowrank", "blocks+embed",
         "norms", "blocks+head_lowrank+embed_lowrank", "all_whole")
SEVEN_B = {"layers": 32, "hidden": 4096, "mlp": 11008, "vocab": 32000, "kv": 4096}
SEVEN_B_PARAMS = 6.74e9


def read_weights(path: str) -> Dict[str, torch.Tensor]:
    """Every weight of a model directory (a repaired one's darts tensors left out), float32."""
    from mergekit_darts.repair.train.delta_init import SafetensorsWeights

    weights = SafetensorsWeights(path)
    return {name: weights.read(name).float() for name in weights.files}


def low_rank(delta: torch.Tensor, rank: int) -> torch.Tensor:
    """The rank-``rank`` truncated SVD of ``delta``, as ``adapter_init: delta`` computes it."""
    from mergekit_darts.repair.train.delta_init import low_rank_factors

    down, up = low_rank_factors(delta, rank)
    return up @ down


def is_block_linear(name: str) -> bool:
    return ".layers." in name and name.endswith("proj.weight")


def is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def low_rank_parts(merged: dict, expert: dict, rank: int) -> dict:
    """W_merge + the rank-r SVD of the delta, once per domain, for every tensor a part may take at rank r."""
    wanted = [n for n in merged if is_block_linear(n) or n in ("lm_head.weight", "model.embed_tokens.weight")]
    return {name: merged[name] + low_rank(expert[name] - merged[name], rank) for name in wanted}


def combined(merged: dict, expert: dict, lowrank: dict, part: str) -> dict:
    out = dict(merged)
    for name in merged:
        if is_block_linear(name) and ("blocks" in part or part == "all_whole"):
            out[name] = lowrank[name]
        elif is_norm(name) and ("norms" in part or part == "all_whole"):
            out[name] = expert[name]
        elif name == "lm_head.weight" and "head_lowrank" in part:
            out[name] = lowrank[name]
        elif name == "lm_head.weight" and ("head" in part or part == "all_whole"):
            out[name] = expert[name]
        elif name == "model.embed_tokens.weight" and (part.endswith("embed") or part == "all_whole"):
            out[name] = expert[name]
        elif name == "model.embed_tokens.weight" and "embed_lowrank" in part:
            out[name] = lowrank[name]
    return out


def share_7b(part: str, rank: int) -> float:
    """Parameters per domain on the 7B shape, as a share of the 7B's parameters."""
    L, H, M, V = SEVEN_B["layers"], SEVEN_B["hidden"], SEVEN_B["mlp"], SEVEN_B["vocab"]
    blocks = L * rank * (4 * (H + H) + 3 * (H + M))  # q k v o: H→H; gate up: H→M, down: M→H
    sizes = {"blocks": blocks, "norms": 2 * L * H + H, "head": V * H, "embed": V * H, "embed_lowrank": rank * (V + H),
             "head_lowrank": rank * (V + H)}
    if part == "all_whole":
        used = ("blocks", "norms", "head", "embed")
    else:
        used = tuple(part.split("+"))
    return round(100 * sum(sizes[p] for p in used) / SEVEN_B_PARAMS, 4)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("demo_dir")
    parser.add_argument("--rank", type=int, default=8)
    add_output_options(parser)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    from bench_quality import load_test
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from mergekit_darts.demo.evaluate import score_model

    family = os.path.join(args.demo_dir, "family")
    test = load_test(args.demo_dir)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(args.demo_dir, "merged"))
    config = AutoConfig.from_pretrained(os.path.join(family, "base"))
    merged = read_weights(os.path.join(args.demo_dir, "merged"))
    scores: Dict[str, Dict[str, float]] = {"merge": {}, "expert": {}, **{part: {} for part in PARTS}}

    def scored(weights: dict, domain: str) -> float:
        model = AutoModelForCausalLM.from_config(config)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight" or config.tie_word_embeddings is False]:
            raise SystemExit(f"weights do not fit the family's config: missing {missing}, unexpected {unexpected}")
        return score_model(model.eval(), tokenizer, test, [domain])[domain]

    for domain in DOMAINS:
        expert = read_weights(os.path.join(family, domain))
        scores["merge"][domain] = scored(merged, domain)
        scores["expert"][domain] = scored(expert, domain)
        lowrank = low_rank_parts(merged, expert, args.rank)
        for part in PARTS:
            scores[part][domain] = scored(combined(merged, expert, lowrank, part), domain)
        log(f"{domain}: " + ", ".join(f"{part} {scores[part][domain]:.0f}" for part in scores))
    shares = {part: share_7b(part, args.rank) for part in PARTS}
    print(f"\n| part (rank {args.rank}) | math | code | instruct | 7B share |\n|---|---|---|---|---|")
    for part, by_domain in scores.items():
        cells = " | ".join(f"{by_domain[d]:.0f}" for d in DOMAINS)
        print(f"| {part} | {cells} | {shares.get(part, '–')} |")
    write_json(f"extract_parts_r{args.rank}", {"machine": machine_info(), "demo_dir": args.demo_dir,
                                              "rank": args.rank, "scores": scores, "share_7b_percent": shares},
               args.out, args.overwrite)


if __name__ == "__main__":
    main()
