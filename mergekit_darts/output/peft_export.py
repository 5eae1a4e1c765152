"""One PEFT LoRA adapter per domain on the plain merge's ``lm_head`` (``mergekit-darts export-peft``).

A foldable domain's head is ``W' = (W + H_u·H_d)·(I − U·D)`` (see ``bake``), so

    W' − W = H_u·H_d − (W + H_u·H_d)·U·D = B·A,   B = [H_u, −(W + H_u·H_d)·U],   A = [H_d; D]

with rank ``head_rank + rank``. With ``lora_alpha = r`` PEFT's scaling is 1 and the adapter on the plain
merged model (OUT loaded without remote code) gives exactly that domain's logits. The files are
written here (safetensors + JSON in PEFT's format) rather than through a PEFT model, so peft is not a
dependency and no model is loaded; tests load them with ``PeftModel.from_pretrained``.
Only ``lora_A``/``lora_B`` are stored (PEFT would also save the whole head for an ``lm_head`` target),
which is also what keeps a tied head working: the adapter adds to the head's output, the shared
embedding matrix is never changed.
"""

import os
from typing import Dict, List, Optional

import torch
from safetensors.torch import save_file

from mergekit_darts.errors import FoldError
from mergekit_darts.output import layout
from mergekit_darts.output.bake import (
    ROW_CHUNK, DomainFold, load_domain_fold, merged_head_source, read_merged_tensor, staged_directory,
)

# PEFT's names for a LoRA on the top-level ``lm_head`` of a causal LM (peft.utils.save_and_load:
# get_peft_model_state_dict drops the adapter name, keeping ``base_model.model.<module>.lora_X.weight``)
LORA_A_KEY = "base_model.model.lm_head.lora_A.weight"
LORA_B_KEY = "base_model.model.lm_head.lora_B.weight"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@torch.no_grad()
def lora_factors(head: torch.Tensor, fold: DomainFold):
    """(B [vocab × r], A [r × hidden]) in float32 with ``B·A = W' − W``, computed in float64."""
    up, down = fold.up.double(), fold.down.double()
    a_parts = ([fold.head_down.double()] if fold.head_up is not None else []) + [down]
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
        parts.append(-(rows @ up))
        lora_b[start:start + ROW_CHUNK] = torch.cat(parts, dim=1).float()
    return lora_b, lora_a.float()


def adapter_config(base_model: str, rank: int) -> dict:
    """PEFT's adapter_config.json for a plain LoRA on ``lm_head`` with scaling 1 (keys PEFT 0.21 writes;
    absent optional keys take PEFT's defaults)."""
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
        "target_modules": ["lm_head"],
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


def export_peft(out_dir: str, dest: str, domains: Optional[List[str]] = None,
                drop_position_bias: bool = False) -> Dict[str, dict]:
    """Write ``dest/<domain>/`` adapters for ``domains`` (default: all); returns {domain: summary}."""
    meta = layout.read_darts_entry(out_dir)
    known = list(meta.get("domains") or {})
    domains = list(domains or known)
    folds = [load_domain_fold(out_dir, name, drop_position_bias) for name in domains]  # all checked first
    if os.path.exists(dest):
        raise FoldError(f"DEST: {os.path.abspath(dest)} already exists; choose a new directory (nothing was overwritten)")
    config = layout.read_config(out_dir)
    layout.plain_architecture(config)  # a FormatError now for an architecture the emitted classes lack
    head = read_merged_tensor(out_dir, merged_head_source(out_dir, config))
    summaries = {}

    def write(stage):
        for fold in folds:
            lora_b, lora_a = lora_factors(head, fold)
            folder = os.path.join(stage, fold.domain)
            os.makedirs(folder)
            save_file({LORA_A_KEY: lora_a.contiguous(), LORA_B_KEY: lora_b.contiguous()},
                      os.path.join(folder, ADAPTER_WEIGHTS), metadata={"format": "pt"})
            layout.write_json(os.path.join(folder, ADAPTER_CONFIG),
                              adapter_config(os.path.abspath(out_dir), lora_a.shape[0]))
            summaries[fold.domain] = {"rank": lora_a.shape[0], "dropped_position_bias": fold.dropped_position_bias}

    staged_directory(dest, write)
    return summaries
