"""One PEFT LoRA adapter per domain on the plain merge (``mergekit-darts export-peft``): on its ``lm_head``
for a linear final-state or head correction, on the block linears for block adapters (``depth``).

A foldable domain's head is ``W' = (W + H_u·H_d)·(I − U·D)`` (see ``bake``), so

    W' − W = H_u·H_d − (W + H_u·H_d)·U·D = B·A,   B = [H_u, −(W + H_u·H_d)·U],   A = [H_d; D]

with rank ``head_rank + rank``. With ``lora_alpha = r`` PEFT's scaling is 1 and the adapter on the plain
merged model (OUT loaded without remote code) gives exactly that domain's logits. The files are
written here (safetensors + JSON in PEFT's format) rather than through a PEFT model, so peft is not a
dependency and no model is loaded; tests load them with ``PeftModel.from_pretrained``.
Only ``lora_A``/``lora_B`` are stored (PEFT would also save the whole head for an ``lm_head`` target).

``DEST/base-model/`` is the plain base the adapters name in ``base_model_name_or_path``
(``plain_base``): the plain architecture and the merged weights, hard-linked from OUT, with an LM head
of its own for a tied merge, so llama.cpp's ``convert_lora_to_gguf.py``, PEFT's ``merge_and_unload`` and
servers all find a separate ``lm_head`` matrix that the LoRA changes without touching the embeddings.

A ``depth: k`` output's block adapters (``y + up(down(x))`` on the last k blocks' linears) are LoRAs
already: they go into the same adapter as ``model.layers.<i>.<path>`` targets (scaling 1, their rank
in ``r``, the head's in ``rank_pattern``), so PEFT — or a server that loads PEFT LoRAs on those
projections — reproduces the domain without remote code. Adapters on linears with a bias (Qwen2's
q/k/v) have a bias of their own: it is written as ``lora_B.bias``, as ``mergekit-extract-lora`` writes
bias deltas, with ``lora_bias: true`` in adapter_config.json. PEFT's ``lora_bias`` holds for every
target, so every other target gets a zero ``lora_B.bias``; PEFT's forward is then exact, but its
``merge_and_unload`` refuses targets whose base layer has no bias (o_proj, the MLP, ``lm_head``):
``mergekit-darts bake`` is the merge of such an output.

A ReLU final-state correction (``content: relu``, with a position table under ``method: darts``; ``preset:
best``'s before 2026-12-06, whose own is linear now and folds into ``lm_head``) has no weight form: ``drop_final_state`` (``--drop-final-state-correction``) exports the rest — the block
adapters and ``H_u·H_d`` on ``lm_head`` (B = H_u, A = H_d; no ``lm_head`` target at head_rank 0) — and
each adapter's README.md says what was dropped (``output/dropped.py``).
"""

import os
from typing import Dict, List, Optional, Sequence

import torch
from safetensors.torch import save_file

from mergekit_darts.errors import FoldError
from mergekit_darts.output import dropped, layout
from mergekit_darts.output.bake import (
    ROW_CHUNK, DomainFold, held_out_kl_note, load_domain_fold, merged_head_source, read_merged_tensor,
)
from mergekit_darts.output.plain_base import write_plain_base
from mergekit_darts.output.staging import staged_directory

# PEFT's names for a LoRA on the top-level ``lm_head`` of a causal LM (peft.utils.save_and_load:
# get_peft_model_state_dict drops the adapter name, keeping ``base_model.model.<module>.lora_X.weight``)
LORA_A_KEY = "base_model.model.lm_head.lora_A.weight"
LORA_B_KEY = "base_model.model.lm_head.lora_B.weight"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# beside DEST/<domain>/; a domain name never contains '-' (config.DOMAIN_NAME), so the two cannot collide
BASE_DIR = "base-model"


@torch.no_grad()
def lora_factors(head: torch.Tensor, fold: DomainFold):
    """(B [vocab × r], A [r × hidden]) in float32 with ``B·A = W' − W``, computed in float64
    (without the final-state correction ``W' − W = H_u·H_d``)."""
    a_parts = ([fold.head_down.double()] if fold.head_up is not None else []) + (
        [fold.down.double()] if fold.up is not None else [])
    lora_a = torch.cat(a_parts, dim=0)
    rank = lora_a.shape[0]
    lora_b = torch.empty(head.shape[0], rank, dtype=torch.float32)
    for start in range(0, head.shape[0], ROW_CHUNK):
        rows = head[start:start + ROW_CHUNK].double()
        parts = []
        if fold.head_up is not None:
            head_up = fold.head_up[start:start + ROW_CHUNK].double()
            rows = rows + head_up @ fold.head_down.double()
            parts.append(head_up)
        if fold.up is not None:
            parts.append(-(rows @ fold.up.double()))
        lora_b[start:start + ROW_CHUNK] = torch.cat(parts, dim=1).float()
    return lora_b, lora_a.float()


def block_lora_tensors(fold: DomainFold) -> Dict[str, torch.Tensor]:
    """A depth output's block adapters under PEFT's names: the adapter on ``model.layers.<i>.<path>``
    (``y + up(down(x))``) is exactly a LoRA with ``lora_A = down``, ``lora_B = up`` and scaling 1; with
    biases (``has_lora_bias``) every adapter's ``lora_B.bias`` too, zero where the adapter has none."""
    tensors = {}
    biases = fold.block_biases or {}
    for name, (down, up) in (fold.blocks or {}).items():
        module = f"base_model.model.model.layers.{name}"
        tensors[f"{module}.lora_A.weight"] = down.contiguous()
        tensors[f"{module}.lora_B.weight"] = up.contiguous()
        if biases:
            tensors[f"{module}.lora_B.bias"] = biases.get(name, torch.zeros(up.shape[0])).contiguous()
    return tensors


def has_lora_bias(fold: DomainFold) -> bool:
    """Whether the domain's adapter needs PEFT's ``lora_bias``: some block adapter has a bias."""
    return bool(fold.block_biases)


def adapter_config(base_model: str, rank: int, block_modules: Sequence[str] = (), block_rank: int = 0,
                   lora_bias: bool = False) -> dict:
    """PEFT's adapter_config.json for a LoRA on ``lm_head`` with scaling 1 (keys PEFT 0.21 writes;
    absent optional keys take PEFT's defaults). ``block_modules`` (depth outputs): full module names
    inside the decoder that carry rank-``block_rank`` LoRAs, also with scaling 1. ``rank`` 0: no
    ``lm_head`` target (block adapters only). ``lora_bias``: every ``lora_B`` has a bias (only then is
    the key written)."""
    patterns = {}
    head = ["lm_head"] if rank else []
    if block_modules:  # r / lora_alpha are the blocks'; the head's own rank goes in the patterns
        patterns = {"lm_head": rank} if rank else {}
        rank = block_rank
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "auto_mapping": None,
        "r": rank,
        "lora_alpha": rank,  # scaling = lora_alpha / r = 1
        "use_rslora": False,
        "use_dora": False,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": [*head, *block_modules],
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": dict(patterns),
        "alpha_pattern": dict(patterns),
        "revision": None,
        **({"lora_bias": True} if lora_bias else {}),
    }


def export_peft(out_dir: str, dest: str, domains: Optional[List[str]] = None,
                drop_position_bias: bool = False, copy_base: bool = False,
                drop_final_state: bool = False, drop_lora_bias: bool = False) -> Dict[str, dict]:
    """Write ``dest/<domain>/`` adapters for ``domains`` (default: all) and their plain base
    ``dest/base-model/`` (weights hard-linked from ``out_dir``, or copied with ``copy_base``);
    returns {domain: summary, ..., "base-model": the base's summary}."""
    meta = layout.read_darts_entry(out_dir)
    known = list(meta.get("domains") or {})
    domains = list(domains or known)
    folds = [load_domain_fold(out_dir, name, drop_position_bias, drop_final_state, drop_lora_bias)  # all checked first
             for name in domains]
    if os.path.exists(dest):
        raise FoldError(f"DEST: {os.path.abspath(dest)} already exists; choose a new directory (nothing was overwritten)")
    config = layout.read_config(out_dir)
    layout.plain_architecture(config)  # a FormatError now for an architecture the emitted classes lack
    # the whole merged head (vocab × hidden) only where some domain's fold changes it (not at head_rank 0
    # without the final-state correction)
    changes_head = any(fold.changes_head for fold in folds)
    head = read_merged_tensor(out_dir, merged_head_source(out_dir, config)) if changes_head else None
    hidden = config.get("hidden_size")
    summaries = {}
    base_path = os.path.join(os.path.abspath(dest), BASE_DIR)  # where the base is once staged in

    def write(stage):
        base = write_plain_base(out_dir, os.path.join(stage, BASE_DIR), copy=copy_base)
        for fold in folds:
            tensors = block_lora_tensors(fold)
            rank = 0
            if fold.changes_head:
                lora_b, lora_a = lora_factors(head, fold)
                tensors.update({LORA_A_KEY: lora_a.contiguous(), LORA_B_KEY: lora_b.contiguous()})
                if has_lora_bias(fold):  # PEFT gives every target a lora_B.bias: the head's is zero
                    tensors[LORA_B_KEY.replace(".weight", ".bias")] = torch.zeros(lora_b.shape[0])
                rank = lora_a.shape[0]
            folder = os.path.join(stage, fold.domain)
            os.makedirs(folder)
            save_file(tensors, os.path.join(folder, ADAPTER_WEIGHTS), metadata={"format": "pt"})
            block_modules = [f"model.layers.{name}" for name in sorted(fold.blocks or {})]
            layout.write_json(os.path.join(folder, ADAPTER_CONFIG),
                              adapter_config(base_path, rank, block_modules, fold.shape.depth_rank,
                                             lora_bias=has_lora_bias(fold)))
            kl = held_out_kl_note(out_dir, fold.domain)
            with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as handle:
                handle.write(dropped.adapter_readme(fold.domain, fold.shape, hidden, len(block_modules), rank,
                                                    fold.dropped_final_state, fold.dropped_position_bias, kl))
            summaries[fold.domain] = {"rank": rank, "dropped_position_bias": fold.dropped_position_bias,
                                      "dropped_final_state": fold.dropped_final_state, "shape": fold.shape,
                                      "hidden_size": hidden, "held_out_kl": kl, "block_modules": len(block_modules),
                                      "lora_bias": has_lora_bias(fold), "dropped_lora_bias": fold.dropped_lora_bias}
        summaries[BASE_DIR] = base

    staged_directory(dest, write)
    return summaries
