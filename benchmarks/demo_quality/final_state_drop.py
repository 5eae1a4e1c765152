"""What ``--drop-final-state-correction`` costs: ``preset: best`` on the demo family, with and without its
final-state correction (docs/serving.md, "Dropping the final-state correction").

``preset: best`` as it was until 2026-12-06 (``RELU``, written into the YAML: the preset's own correction
is linear since) trains block adapters in every block *and* a final-state correction (ReLU content of
rank 64 plus a position table). Only the block adapters are LoRAs; ``bake`` / ``export-peft`` with
``--drop-final-state-correction`` serve them alone (exactly: tests/test_peft_export_preset.py). This
script measures what the dropped part was worth on the demo's family (``mergekit_darts.demo``: the same
data, family, YAML and scoring as ``mergekit-darts demo``, seed given by ``--seed``):

1. builds (or reuses) the family in WORKDIR and runs the demo's YAML with ``preset: best`` (the preset's
   own method, loss, rank, steps, lr; the demo's 50 prompts per domain with the expert's answers) through
   ``mergekit-yaml``;
2. per domain, ``mergekit-darts bake --domain D --drop-final-state-correction`` (a plain LlamaForCausalLM,
   the same logits as base + ``export-peft``'s adapter);
3. scores the demo's held-out test problems (greedy completions scored as the demo scores them) with the
   plain merge, the repaired model (remote code, every part) and each baked model (without the
   final-state correction), counts how many of those completions equal the expert's own greedy
   completion, and reads the held-out KL to the expert from darts_report.json (``before``, ``after``,
   ``after_without_final_state``: the held-out calibration records, measured at training).

A rerun with the same WORKDIR reuses the family (the demo's stamp) and, when ``best.yml`` is unchanged and
its output complete, the trained output: only the bakes and the scoring run again.

``--foldable`` (issue 52): the preset trained from the start without the parts that have no weight form
(``content: linear``, ``method: standard``: the final-state correction folds into the LM head, no position
table), baked whole, no flag; its "without" row is then the baked model itself (the same correction).

Usage: python benchmarks/demo_quality/final_state_drop.py [--workdir DIR] [--seed 0] [--foldable]
Writes benchmarks/results/final_state_drop.json (final_state_drop_foldable.json with --foldable; ``--output``
to choose) and prints a table.
"""

import argparse
import os
import shutil
import subprocess
import sys
import time

import torch
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import add_output_options, log, machine_info, print_table, write_json  # noqa: E402

BIN = os.path.dirname(sys.executable)
# the demo YAML's explicit surgery keys, which would win over the preset's
PRESET_OWNED = ("method", "loss", "rank", "steps", "lr", "head_rank", "content", "depth", "depth_rank")


# the preset trained without the parts that have no weight form (issue 52): a linear final-state correction
# (it folds into the LM head) and no position table; everything else is the preset's
FOLDABLE = {"content": "linear", "method": "standard"}
# the final-state correction preset: best had until 2026-12-06 (ReLU content + position table), written
# explicitly now that the preset's own is FOLDABLE
RELU = {"content": "relu", "method": "darts"}


def preset_yaml(workdir, paths, seed, sizes, foldable=False):
    from mergekit_darts.demo.run import merge_yaml

    config = yaml.safe_load(merge_yaml(workdir, paths, seed, sizes))
    surgery = {key: value for key, value in config["surgery"].items() if key not in PRESET_OWNED}
    config["surgery"] = {"preset": "best", **(FOLDABLE if foldable else RELU), **surgery}
    return yaml.safe_dump(config, sort_keys=False)


def run(workdir: str, seed: int, foldable: bool = False) -> dict:
    from mergekit_darts.demo import tasks
    from mergekit_darts.demo.evaluate import generate, score_completions
    from mergekit_darts.demo.family import build_family
    from mergekit_darts.demo.run import DemoSizes, make_data
    from mergekit_darts.output.layout import read_json
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sizes = DemoSizes()
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    seconds = {}
    started = time.perf_counter()
    splits = make_data(workdir, seed, sizes)
    paths = build_family(os.path.join(workdir, "family"), splits, tasks.vocabulary(splits.values()), seed=seed,
                         spec=sizes.family, progress=False, log=log)
    seconds["family"] = round(time.perf_counter() - started, 1)

    suffix = "_foldable" if foldable else ""
    config_path, out = os.path.join(workdir, f"best{suffix}.yml"), os.path.join(workdir, f"merged_best{suffix}")
    text = preset_yaml(workdir, paths, seed, sizes, foldable)
    previous = open(config_path).read() if os.path.exists(config_path) else None
    if previous == text and os.path.exists(os.path.join(out, "darts_report.json")):
        log(f"reusing {out} (trained from the same {config_path})")
    else:
        with open(config_path, "w") as handle:
            handle.write(text)
        shutil.rmtree(out, ignore_errors=True)
        started = time.perf_counter()
        log(f"mergekit-yaml {config_path} {out}")
        subprocess.run([os.path.join(BIN, "mergekit-yaml"), config_path, out], check=True)
        seconds["merge+surgery"] = round(time.perf_counter() - started, 1)

    domains = list(tasks.DOMAINS)
    baked = {}
    for domain in domains:
        baked[domain] = os.path.join(workdir, f"baked{suffix}_{domain}")
        shutil.rmtree(baked[domain], ignore_errors=True)
        # the foldable preset bakes whole (no flag); today's drops its final-state correction
        subprocess.run([os.path.join(BIN, "mergekit-darts"), "bake", out, baked[domain], "--domain", domain,
                        *([] if foldable else ["--drop-final-state-correction"])], check=True)

    tokenizer = AutoTokenizer.from_pretrained(out)
    test = {d: splits[d]["test"] for d in domains}
    started = time.perf_counter()
    load = AutoModelForCausalLM.from_pretrained
    accuracy, expert_match = {}, {}
    repaired = load(out, trust_remote_code=True, darts_domain=domains[0]).eval()
    merged = load(out).eval()  # no remote code: the plain merge
    for domain in domains:
        prompts = [example["prompt"] for example in test[domain]]
        tokens = tasks.MAX_NEW_TOKENS[domain]
        expert = generate(load(paths[domain]).eval(), tokenizer, prompts, tokens)
        repaired.set_darts_domain(domain)
        for name, model in (("expert", None), ("merged", merged), ("repaired", repaired),
                            ("without", load(baked[domain]).eval())):
            completions = expert if model is None else generate(model, tokenizer, prompts, tokens)
            solved = score_completions(domain, test[domain], completions)
            accuracy.setdefault(name, {})[domain] = round(100.0 * sum(solved) / len(solved), 1)
            expert_match.setdefault(name, {})[domain] = round(
                100.0 * sum(c == e for c, e in zip(completions, expert)) / len(expert), 1)
    seconds["scoring"] = round(time.perf_counter() - started, 1)

    report = read_json(os.path.join(out, "darts_report.json"))
    kl = {domain: report["domains"][domain]["held_out_kl"] for domain in domains}
    return {"machine": machine_info(), "seed": seed, "preset": report["surgery"].get("preset"), "foldable": foldable,
            "baked": "whole (no flag)" if foldable else "--drop-final-state-correction",
            "surgery": {key: report["surgery"].get(key) for key in PRESET_OWNED},
            "test_problems": {d: len(test[d]) for d in domains}, "accuracy": accuracy,
            "same_greedy_completion_as_the_expert": expert_match, "held_out_kl": kl,
            "seconds": seconds}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="./final_state_drop")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--foldable", action="store_true", help="train the preset with content: linear and "
                        "method: standard (no part without a weight form) and bake it whole")
    add_output_options(parser)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.manual_seed(args.seed)
    data = run(args.workdir, args.seed, args.foldable)
    rows = []
    for domain, kl in data["held_out_kl"].items():
        for name, value in (("merged", kl["before"]), ("repaired", kl["after"]),
                            ("without", kl["after" if data["foldable"] else "after_without_final_state"])):
            rows.append([domain, name, data["accuracy"][name][domain],
                         data["same_greedy_completion_as_the_expert"][name][domain], f"{value:.4f}"])
    print_table("preset: best with and without its final-state correction (expert solves "
                + ", ".join(f"{d} {v}" for d, v in data["accuracy"]["expert"].items()) + ")",
                ["domain", "model", "solved %", "same completion as the expert %", "held-out KL"], rows)
    path = write_json("final_state_drop_foldable" if args.foldable else "final_state_drop", data, args.out,
                      args.overwrite)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
