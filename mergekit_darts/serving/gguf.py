"""``mergekit-darts export-gguf``: the files llama-server and Ollama serve, made by llama.cpp's converters.

DEST gets ``base.gguf`` (the plain merge, ``convert_hf_to_gguf.py``), ``lora-<domain>.gguf`` per domain
(``export-peft``'s adapter through ``convert_lora_to_gguf.py --base``), ``Modelfile.<domain>`` for Ollama
(``FROM ./base.gguf`` + ``ADAPTER ./lora-<domain>.gguf``) and ``SERVING.md`` with the llama-server and
``mergekit-darts serve`` command lines for this output. A domain whose LoRAs have different ranks (block
adapters and a head correction) is first padded to one rank (``uniform_rank``): llama.cpp has one
``lora_alpha`` per adapter file. The PEFT adapters are written to a scratch
folder inside the staging directory and removed (``export-peft`` writes them for PEFT and vLLM).

Parts llama.cpp cannot take are refused before anything is written, by the same checks as
``export-peft`` (a position table, a ReLU final-state correction: ``--drop-…`` exports the rest), and
adapters with a LoRA bias (``convert_lora_to_gguf.py`` has no case for ``lora_B.bias``:
``--drop-lora-bias``).
"""

import json
import os
import shutil
import subprocess
import sys
from typing import Dict, List, Optional

from mergekit_darts.errors import FoldError
from mergekit_darts.output.layout import read_config, read_darts_entry
from mergekit_darts.output.staging import staged_directory

CONVERTERS = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py")
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
BASE_GGUF = "base.gguf"


def lora_gguf(domain: str) -> str:
    return f"lora-{domain}.gguf"


def check_converters(llama_cpp: str) -> None:
    missing = [name for name in CONVERTERS if not os.path.isfile(os.path.join(llama_cpp, name))]
    if missing:
        raise FoldError(f"--llama-cpp {llama_cpp}: no {', '.join(missing)}; give llama.cpp's source folder "
                        "(git clone https://github.com/ggml-org/llama.cpp, or vendor/llama.cpp of the "
                        "llama-cpp-python sdist)")


def _convert(command: List[str], what: str) -> None:
    result = subprocess.run([sys.executable, *command], capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        raise FoldError(f"{what}: llama.cpp's {os.path.basename(command[0])} failed ({last})")


def uniform_rank(folder: str) -> Optional[int]:
    """Give every LoRA of a PEFT adapter folder one rank, in place; returns it (None: already uniform).

    llama.cpp scales each LoRA by ``lora_alpha / its own rank`` with one ``lora_alpha`` per file
    (``convert_lora_to_gguf.py`` reads no ``alpha_pattern``), so a head LoRA of rank 6 beside block
    LoRAs of rank 4 (``export-peft``'s ``rank_pattern``/``alpha_pattern``, scaling 1 in PEFT) would run
    at 4/6. Zero rows of ``lora_A`` and zero columns of ``lora_B`` up to the largest rank leave every
    product unchanged; ``r = lora_alpha`` = that rank then gives scaling 1 everywhere."""
    import torch
    from safetensors.torch import load_file, save_file

    config_path = os.path.join(folder, "adapter_config.json")
    with open(config_path, encoding="utf-8") as handle:
        config = json.load(handle)
    if not config.get("rank_pattern") and not config.get("alpha_pattern"):
        return None
    weights_path = os.path.join(folder, "adapter_model.safetensors")
    tensors = load_file(weights_path)
    rank = max(t.shape[0] for key, t in tensors.items() if key.endswith("lora_A.weight"))
    for key, tensor in list(tensors.items()):
        if key.endswith("lora_A.weight") and tensor.shape[0] < rank:
            tensors[key] = torch.cat([tensor, tensor.new_zeros(rank - tensor.shape[0], tensor.shape[1])])
        elif key.endswith("lora_B.weight") and tensor.shape[1] < rank:
            tensors[key] = torch.cat([tensor, tensor.new_zeros(tensor.shape[0], rank - tensor.shape[1])], dim=1)
    save_file(tensors, weights_path, metadata={"format": "pt"})
    config.update(r=rank, lora_alpha=rank, rank_pattern={}, alpha_pattern={})
    with open(config_path, "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=1)
    return rank


def serving_commands(out: str, dest: str, domains: List[str], router_states: Optional[str]) -> str:
    """SERVING.md: the command lines, with DEST's and OUT's paths."""
    loras = " ".join(f"--lora {os.path.join(dest, lora_gguf(d))}" for d in domains)
    base = os.path.join(dest, BASE_GGUF)
    lines = ["# Serving this export", "",
             "llama-server with every domain's LoRA loaded and none applied (each request names its own):", "",
             "```bash", f"llama-server -m {base} {loras} --lora-init-without-apply --jinja --port 8080", "```", ""]
    if router_states is None:
        lines += ["OUT has no router: pick the domain per request with llama-server's `lora` field.", ""]
    else:
        lines += ["Routed per request by OUT's own router (docs/serving.md#routed-serving):", "", "```bash"]
        if router_states == "final":
            lines += ["# the router reads the plain merge's final states: a second server on the same base GGUF",
                      f"llama-server -m {base} --embeddings --pooling mean --port 8081 -b 4096 -ub 4096",
                      f"mergekit-darts serve {out} --engine http://127.0.0.1:8080 --states-engine http://127.0.0.1:8081"]
        else:
            lines += [f"mergekit-darts serve {out} --engine http://127.0.0.1:8080"]
        lines += ["```", ""]
    lines += ["Ollama, one model per domain:", "", "```bash"]
    lines += [f"ollama create {os.path.basename(os.path.normpath(out))}-{d} -f {os.path.join(dest, 'Modelfile.' + d)}"
              for d in domains]
    return "\n".join(lines + ["```", ""])


def export_gguf(out: str, dest: str, llama_cpp: str, outtype: str = "f16", domains: Optional[List[str]] = None,
                drop_position_bias: bool = False, drop_final_state: bool = False,
                drop_lora_bias: bool = False) -> tuple:
    """Write DEST (module docstring); returns ({file name: what it is}, export-peft's summary per domain:
    what was dropped and what it cost)."""
    from mergekit_darts.output.peft_export import BASE_DIR, export_peft, has_lora_bias, load_domain_fold

    if outtype not in OUTTYPES:
        raise FoldError(f"--outtype: {outtype!r} is not one of {OUTTYPES}")
    check_converters(llama_cpp)
    meta = read_darts_entry(out)
    domains = list(domains or meta.get("domains") or {})
    for domain in domains:  # refusals before anything is written
        fold = load_domain_fold(out, domain, drop_position_bias, drop_final_state, drop_lora_bias)
        if has_lora_bias(fold):
            raise FoldError(f"domain {domain}: its block adapters carry a bias ({read_config(out).get('model_type')} "
                            "q/k/v), which llama.cpp's convert_lora_to_gguf.py cannot take; pass --drop-lora-bias "
                            "to export them without it (the command prints the held-out KL it costs), or "
                            "`mergekit-darts bake` one domain with the biases folded")
    router = meta.get("router")
    states = None if not isinstance(router, dict) else router.get("states", "final")
    dest = os.path.abspath(dest)
    files: Dict[str, str] = {}
    summaries: Dict[str, dict] = {}

    def write(stage: str) -> None:
        peft = os.path.join(stage, ".peft")
        summaries.update(export_peft(out, peft, domains, drop_position_bias=drop_position_bias,
                                     drop_final_state=drop_final_state, drop_lora_bias=drop_lora_bias))
        summaries.pop(BASE_DIR, None)
        base_dir = os.path.join(peft, BASE_DIR)
        _convert([os.path.join(llama_cpp, CONVERTERS[0]), base_dir, "--outfile", os.path.join(stage, BASE_GGUF),
                  "--outtype", outtype], "base.gguf")
        files[BASE_GGUF] = f"the plain merge ({outtype})"
        for domain in domains:
            uniform_rank(os.path.join(peft, domain))
            _convert([os.path.join(llama_cpp, CONVERTERS[1]), os.path.join(peft, domain), "--base", base_dir,
                      "--outfile", os.path.join(stage, lora_gguf(domain)), "--outtype", outtype], lora_gguf(domain))
            with open(os.path.join(stage, f"Modelfile.{domain}"), "w", encoding="utf-8") as handle:
                handle.write(f"FROM ./{BASE_GGUF}\nADAPTER ./{lora_gguf(domain)}\n")
            files[lora_gguf(domain)] = f"{domain}'s correction as a LoRA on {BASE_GGUF}"
            files[f"Modelfile.{domain}"] = f"Ollama: {BASE_GGUF} with {domain}'s LoRA"
        shutil.rmtree(peft)
        with open(os.path.join(stage, "SERVING.md"), "w", encoding="utf-8") as handle:
            handle.write(serving_commands(os.path.abspath(out), dest, domains, states))
        files["SERVING.md"] = "the llama-server, mergekit-darts serve and ollama command lines"
        with open(os.path.join(stage, "export_gguf.json"), "w", encoding="utf-8") as handle:
            json.dump({"source": os.path.abspath(out), "outtype": outtype, "domains": domains,
                       "dropped_final_state": drop_final_state, "dropped_position_bias": drop_position_bias,
                       "dropped_lora_bias": any(s.get("dropped_lora_bias") for s in summaries.values())}, handle,
                      indent=1)

    staged_directory(dest, write)
    return files, summaries
