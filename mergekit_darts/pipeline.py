"""merge → capture → train → export (DESIGN §4); used by the mergekit hook and the CLI alike."""

import copy
import logging
import os
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import torch
import yaml

from .config import SurgeryConfig, SurgeryConfigError, parse_surgery_block, split_yaml

LOG = logging.getLogger(__name__)


def parse_config_source(
    config_source: str, overrides: Optional[Dict[str, Any]] = None
) -> Tuple[Dict[str, Any], Optional[SurgeryConfig]]:
    """(mergekit part of the YAML, validated surgery block or None); ``overrides`` update ``surgery:``."""
    try:
        merge_part, surgery_raw = split_yaml(config_source)
    except yaml.YAMLError as error:
        raise SurgeryConfigError(f"config: not valid YAML: {error}") from None
    if surgery_raw is None:
        if overrides:
            raise SurgeryConfigError("surgery: the config has no surgery: block to override")
        return merge_part, None
    if overrides:
        if not isinstance(surgery_raw, dict):
            raise SurgeryConfigError("surgery: expected a mapping")
        surgery_raw = {**copy.deepcopy(surgery_raw), **overrides}
    return merge_part, parse_surgery_block(surgery_raw)


def effective_seed(surgery: SurgeryConfig, options=None) -> int:
    if surgery.seed is not None:
        return surgery.seed
    if options is not None and getattr(options, "random_seed", None) is not None:
        return int(options.random_seed)
    return 0


def effective_device(surgery: SurgeryConfig, options=None) -> str:
    """The surgery's own ``device`` wins; with ``auto``, mergekit's --cuda/--device choose."""
    if surgery.device != "auto" or options is None:
        return surgery.device
    device = getattr(options, "device", None)
    if getattr(options, "cuda", False) or (device and str(device).startswith("cuda")):
        return str(device) if device and str(device).startswith("cuda") else "cuda"
    return "auto"


def merge_and_repair(config_source: str, out_path: str, options=None) -> Optional[dict]:
    """What ``mergekit-yaml`` does with a ``surgery:`` block: validate, merge, repair.

    Returns the surgery report (None when the YAML has no surgery block: a plain merge).
    """
    from mergekit.config import MergeConfiguration
    from mergekit.options import MergeOptions

    from . import hook

    options = options or MergeOptions()
    merge_part, _ = parse_config_source(config_source)
    merge_config = MergeConfiguration.model_validate(merge_part)
    # the wrapped run_merge validates, merges and runs the surgery: one code path for both entry points
    return hook.run_merge_with_surgery(
        hook.original_run_merge(), merge_config, out_path, options, config_source=config_source
    )


def run_surgery(
    config_source: str, out_path: str, *, overrides: Optional[Dict[str, Any]] = None, options=None,
    progress: Optional[bool] = None,
) -> dict:
    """Surgery only, on an existing merged directory ``out_path``; returns the report."""
    from .preflight import check_surgery

    merge_part, surgery = parse_config_source(config_source, overrides)
    if surgery is None:
        raise SurgeryConfigError("surgery: the config has no surgery: block")
    if not os.path.isfile(os.path.join(out_path, "config.json")):
        raise SurgeryConfigError(f"{out_path}: not a merged model directory (no config.json); run the merge first")
    trust = bool(getattr(options, "trust_remote_code", False))
    texts = check_surgery(surgery, merged_config_path=out_path, seed=effective_seed(surgery, options),
                          trust_remote_code=trust)
    return repair_directory(out_path, surgery, options=options, progress=progress, texts=texts)


def _split_held_out(n: int, share: float, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    held = int(round(share * n)) if share > 0 and n >= 2 else 0
    held = min(held, n - 1)
    return order[held:].sort().values, order[:held].sort().values


def repair_directory(out_path: str, surgery: SurgeryConfig, options=None, progress: Optional[bool] = None,
                     texts: Optional[Dict[str, List[str]]] = None) -> dict:
    """capture → train → export on a merged directory. Atomic: on failure ``out_path`` stays a plain merge.

    ``texts``: each domain's calibration texts as the pre-merge checks loaded them (else loaded here).
    """
    from transformers import AutoTokenizer

    from .calibration import apply_chat_template, load_calibration_texts
    from .capture import DomainCaptureSpec, capture_domains, resolve_device
    from .export import export_surgery
    from .report import bias_by_position, plot_bias
    from .surgery import DomainSurgery, count_parameters
    from .train import train_surgery

    quiet = bool(getattr(options, "quiet", False))
    progress = (not quiet) if progress is None else progress
    trust = bool(getattr(options, "trust_remote_code", False))
    seed = effective_seed(surgery, options)
    device = effective_device(surgery, options)

    tokenizer = AutoTokenizer.from_pretrained(out_path, trust_remote_code=trust)
    specs = []
    for name, domain in surgery.domains.items():
        where = f"surgery.domains.{name}.calibration"
        domain_texts = texts[name] if texts is not None else load_calibration_texts(domain.calibration, seed, where)
        if domain.calibration.chat_template:
            domain_texts = apply_chat_template(domain_texts, tokenizer, where=f"{where}.chat_template")
        specs.append(DomainCaptureSpec(name=name, expert=domain.model, texts=domain_texts,
                                       continue_tokens=domain.calibration.continue_tokens,
                                       add_special_tokens=not domain.calibration.chat_template))
    captured = capture_domains(
        out_path, specs, surgery.max_positions, dtype=surgery.dtype, device=device,
        batch_size=surgery.capture_batch_size, cache_dir=surgery.cache_dir, trust_remote_code=trust,
        progress=progress,
    )
    train_device = resolve_device(device)
    merged_head = captured.merged_head.to(train_device, torch.float32)

    modules: Dict[str, DomainSurgery] = {}
    report: Dict[str, Any] = {"surgery": _settings(surgery, seed), "domains": {}}
    for name, data in captured.domains.items():
        n = data.merged_hidden.shape[0]
        train_idx, held_idx = _split_held_out(n, surgery.held_out, seed)
        tensors = {
            "merged": data.merged_hidden, "target": data.expert_hidden, "mask": data.attention_mask,
            "position_ids": data.position_ids, "entropy": data.expert_entropy,
        }
        # promote the cached (often bfloat16) states once, not at every step
        train = {k: v[train_idx].to(train_device) for k, v in tensors.items()}
        train["merged"], train["target"] = train["merged"].float(), train["target"].float()
        torch.manual_seed(seed)
        module = DomainSurgery(
            hidden_size=data.merged_hidden.shape[-1], rank=surgery.rank, max_positions=surgery.max_positions,
            method=surgery.method, head_rank=surgery.head_rank, vocab_size=merged_head.shape[0],
        )
        history = train_surgery(
            module, train["merged"], train["target"], train["mask"], train["position_ids"],
            entropy=train["entropy"], loss=surgery.loss, steps=surgery.steps, lr=surgery.lr,
            batch_size=surgery.batch_size, seed=seed,
            expert_head=data.expert_head.to(train_device, torch.float32) if surgery.loss == "kl" else None,
            merged_head=merged_head if surgery.loss == "kl" else None,
            kl_chunk_size=surgery.kl_chunk_size, progress=progress, desc=f"surgery[{name}]",
        )
        module = module.cpu().eval()
        modules[name] = module
        entry: Dict[str, Any] = {
            "expert": surgery.domains[name].model,
            "calibration": {"train": int(train_idx.numel()), "held_out": int(held_idx.numel()),
                            "truncated": int(data.truncated), "skipped": int(data.skipped)},
            "final_loss": history[-1] if history else None,
            "parameters": count_parameters(module),
        }
        eval_idx = held_idx if held_idx.numel() else train_idx
        entry["bias_split"] = "held_out" if held_idx.numel() else "train"
        held = {k: v[eval_idx] for k, v in tensors.items()}
        with torch.no_grad():
            corrected = module(held["merged"].float(), held["position_ids"])
        entry["bias"] = bias_by_position(
            held["merged"].float(), held["target"].float(), held["mask"], held["position_ids"],
            held["entropy"], corrected, max_positions=surgery.max_positions,
        )
        # whatever the training loss, report how much of the expert's next-token distribution the
        # correction recovers: the quantity that decides generation (DESIGN §3, kl)
        entry["held_out_kl"] = _held_out_kl(module, held, data.expert_head, captured.merged_head,
                                            surgery.kl_chunk_size)
        report["domains"][name] = entry
        LOG.info("domain %s: held-out bias %.4f -> %.4f", name, entry["bias"]["mean_before"],
                 entry["bias"]["mean_after"])

    darts_meta = {
        "method": surgery.method, "loss": surgery.loss, "rank": surgery.rank, "head_rank": surgery.head_rank,
        "max_positions": surgery.max_positions,
        "domains": {name: d.model for name, d in surgery.domains.items()},
    }
    with tempfile.TemporaryDirectory() as tmp:
        plot_path = os.path.join(tmp, "darts_bias.png")
        extra = {}
        try:
            plot_bias(report, plot_path)
            extra["darts_bias.png"] = plot_path
        except Exception as error:  # a plot must never cost the user their surgery
            LOG.warning("could not draw darts_bias.png: %s", error)
        export_surgery(out_path, modules, darts_meta, surgery.active_domain, report=report, extra_files=extra)
    return report


@torch.no_grad()
def _held_out_kl(module, held, expert_head, merged_head, chunk_size) -> Dict[str, float]:
    """Mean KL(expert || merged) before and after the correction on held-out positions, and the
    share of that gap the correction closes (1 = the expert's distribution, 0 = the plain merge)."""
    from .losses import kl_loss

    mask = held["mask"].bool()
    merged = held["merged"].float()
    target = held["target"].float()[mask]
    before = kl_loss(merged[mask], target, expert_head, merged_head, chunk_size=chunk_size)
    corrected = module(merged, held["position_ids"])[mask]
    head = module.head_correction if module.head_rank > 0 else None
    after = kl_loss(corrected, target, expert_head, merged_head, head_correction=head, chunk_size=chunk_size)
    gap_closed = 1.0 - float(after) / float(before) if float(before) > 0 else None
    return {"before": float(before), "after": float(after), "gap_closed": gap_closed}


def _settings(surgery: SurgeryConfig, seed: int) -> Dict[str, Any]:
    data = surgery.model_dump(exclude={"domains"})
    data["seed"] = seed
    return data
