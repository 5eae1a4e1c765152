"""Does llama.cpp's LoRA converter take a ``preset: best`` export? (docs/serving.md, issue 46 item 4)

Not in CI: it needs llama.cpp's converters, which ship in the llama-cpp-python source archive
(``pip download --no-binary :all: --no-deps llama-cpp-python``, unpacked: ``vendor/llama.cpp/``
holds ``convert_hf_to_gguf.py``, ``convert_lora_to_gguf.py``, ``conversion/`` and ``gguf-py``); no
llama.cpp build is needed, nothing is run in llama.cpp. On a random tiny Llama family
(``mergekit_darts.tiny``) it

1. runs ``preset: best`` (ranks 2, depth every block: the tiny model's hidden size is 32) for a few steps,
   with ``head_rank`` 0 (the preset's) and 2;
2. ``mergekit-darts export-peft --drop-final-state-correction``;
3. ``convert_hf_to_gguf.py`` on ``DEST/base-model`` and ``convert_lora_to_gguf.py --base DEST/base-model``
   on each adapter (``--outtype f32``; the base's conversion is recorded, not required: the random tiny
   tokenizer is no pre-tokenizer llama.cpp knows, and the LoRA converter reads only the base's config
   and tensor shapes);
4. reads every GGUF LoRA with gguf-py's ``GGUFReader`` and compares each ``lora_a``/``lora_b`` tensor with
   the adapter's safetensors (llama.cpp names: ``blk.<i>.attn_q.weight.lora_a``, ``output.weight.lora_b``),
   after the one change llama.cpp makes on purpose: the rows of ``attn_q``/``attn_k`` (and so their
   ``lora_b``) are permuted for its rotary layout (``permute`` of ``LlamaModel.modify_tensors``).

Usage: python benchmarks/serving/llama_cpp_convert_preset.py --llama-cpp-src DIR [--workdir DIR]
Writes benchmarks/results/llama_cpp_convert_preset.json.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import add_output_options, log, machine_info, write_json  # noqa: E402

# PEFT module path (below model.layers.<i>.) -> llama.cpp tensor name (below blk.<i>.)
LLAMA_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def gguf_name(peft_key: str) -> str:
    """``base_model.model.model.layers.1.mlp.up_proj.lora_A.weight`` -> ``blk.1.ffn_up.weight.lora_a``."""
    module, factor = peft_key[len("base_model.model."):].rsplit(".lora_", 1)
    suffix = "lora_a" if factor.startswith("A") else "lora_b"
    if module == "lm_head":
        return f"output.weight.{suffix}"
    layer, path = module[len("model.layers."):].split(".", 1)
    return f"blk.{layer}.{LLAMA_NAMES[path]}.weight.{suffix}"


def rotary_permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's row order for q/k projections (convert_hf_to_gguf: LlamaModel.permute)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def expected_in_gguf(name: str, tensor: torch.Tensor, config: dict) -> torch.Tensor:
    heads = config["num_attention_heads"]
    if name.endswith("attn_q.weight.lora_b"):
        return rotary_permute(tensor, heads)
    if name.endswith("attn_k.weight.lora_b"):
        return rotary_permute(tensor, config.get("num_key_value_heads") or heads)
    return tensor


def preset_output(root, head_rank):
    from mergekit_darts.pipeline import run_surgery
    from mergekit_darts.tiny import make_family

    family_dir = os.path.join(root, "family")
    if not os.path.isdir(family_dir):
        paths = make_family(family_dir, arch="llama", domains=["math", "code"], seed=0)
    else:
        paths = {name: os.path.join(family_dir, name) for name in ("base", "math", "code")}
    merged = os.path.join(root, "merged")
    merge = (f"merge_method: task_arithmetic\nbase_model: {paths['base']}\nmodels:\n"
             + "".join(f"  - model: {paths[d]}\n    parameters: {{weight: 0.5}}\n" for d in ("math", "code"))
             + "dtype: float32\n")
    if not os.path.isdir(merged):  # the plain merge (no surgery: block), by mergekit itself
        import yaml
        from mergekit.config import MergeConfiguration
        from mergekit.merge import run_merge
        from mergekit.options import MergeOptions

        run_merge(MergeConfiguration.model_validate(yaml.safe_load(merge)), merged, options=MergeOptions(quiet=True),
                  config_source=merge)
    texts = {"math": ["what is 1 plus 2 ?", "how many apples are left", "add 3 and 4"],
             "code": ["def sum list", "write code to reverse a list", "print the sum"]}
    domains = "".join(f"    {d}:\n      model: {paths[d]}\n      calibration: {{texts: {texts[d]}, samples: 3}}\n"
                      for d in ("math", "code"))
    config = merge + (f"surgery:\n  preset: best\n  rank: 2\n  depth_rank: 2\n  head_rank: {head_rank}\n"
                      f"  max_positions: 16\n  steps: 5\n  lr: 0.01\n  device: cpu\n  held_out: 0.34\n"
                      f"  cache_dir: {os.path.join(root, 'cache')}\n  domains:\n" + domains)
    out = os.path.join(root, f"out_head{head_rank}")
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(merged, out)
    run_surgery(config, out)
    return out


def check(root, vendor, head_rank) -> dict:
    from gguf import GGUFReader
    from safetensors.torch import load_file

    out = preset_output(root, head_rank)
    dest = os.path.join(root, f"adapters_head{head_rank}")
    shutil.rmtree(dest, ignore_errors=True)
    mergekit_darts = os.path.join(os.path.dirname(sys.executable), "mergekit-darts")
    exported = subprocess.run([mergekit_darts, "export-peft", out, dest, "--drop-final-state-correction"],
                              capture_output=True, text=True, check=True)
    env = {**os.environ, "PYTHONPATH": os.path.join(vendor, "gguf-py") + os.pathsep + vendor}
    base_gguf = os.path.join(root, f"base_head{head_rank}.gguf")
    # the random tiny tokenizer is no BPE pre-tokenizer llama.cpp knows ("update get_vocab_base_pre()"):
    # the base may not convert; the LoRA converter reads only the base's config and tensor shapes
    base = subprocess.run([sys.executable, os.path.join(vendor, "convert_hf_to_gguf.py"),
                           os.path.join(dest, "base-model"), "--outtype", "f32", "--outfile", base_gguf],
                          env=env, capture_output=True, text=True)
    record = {"export_peft_output": exported.stdout.strip().splitlines(), "domains": {},
              "base_conversion": {"returncode": base.returncode, "stderr_tail": base.stderr.strip().splitlines()[-1:]}}
    for domain in ("math", "code"):
        lora_gguf = os.path.join(root, f"{domain}_head{head_rank}.gguf")
        converted = subprocess.run([sys.executable, os.path.join(vendor, "convert_lora_to_gguf.py"),
                                    os.path.join(dest, domain), "--base", os.path.join(dest, "base-model"),
                                    "--outtype", "f32", "--outfile", lora_gguf], env=env, capture_output=True,
                                   text=True)
        entry = {"returncode": converted.returncode, "stderr_tail": converted.stderr.strip().splitlines()[-3:]}
        if converted.returncode == 0:
            ours = load_file(os.path.join(dest, domain, "adapter_model.safetensors"))
            with open(os.path.join(dest, "base-model", "config.json")) as handle:
                config = json.load(handle)
            theirs = {t.name: torch.from_numpy(t.data.copy()) for t in GGUFReader(lora_gguf).tensors}
            worst, missing = 0.0, []
            for key, tensor in ours.items():
                name = gguf_name(key)
                if name not in theirs:
                    missing.append(name)
                    continue
                expected = expected_in_gguf(name, tensor, config)
                worst = max(worst, float((theirs[name].reshape(tensor.shape).float() - expected).abs().max()))
            entry.update({"tensors_in_adapter": len(ours), "tensors_in_gguf": len(theirs),
                          "missing_in_gguf": missing, "max_abs_diff": worst})
        record["domains"][domain] = entry
        log(f"head_rank {head_rank}, {domain}: {entry}")
    return record


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp-src", required=True)
    parser.add_argument("--workdir", default="./llama_cpp_convert_preset")
    add_output_options(parser)
    args = parser.parse_args()
    vendor = os.path.join(os.path.abspath(args.llama_cpp_src), "vendor", "llama.cpp")
    sys.path[:0] = [os.path.join(vendor, "gguf-py")]
    root = os.path.abspath(args.workdir)
    os.makedirs(root, exist_ok=True)
    data = {"machine": machine_info(), "llama_cpp_src": os.path.basename(os.path.normpath(args.llama_cpp_src)),
            "head_rank": {str(rank): check(root, vendor, rank) for rank in (0, 2)}}
    write_json("llama_cpp_convert_preset", data, args.out, args.overwrite)


if __name__ == "__main__":
    main()
