"""The one entrance: validate → merge → capture → train each domain → export (docs/design.md §4).

``merge_and_repair`` takes mergekit's own ``run_merge`` as an argument: the start-up hook passes the
function it wraps, the command line passes the unwrapped original. This module imports neither the
hook nor the command line. Settings (seed, device, dtype, trust_remote_code, progress) are resolved
once into a ``RunSettings`` here and handed to every step.
"""

import copy
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import yaml

from mergekit_darts.config import (SurgeryConfig, SurgeryConfigError, parse_surgery_block, preset_settings,
                                   split_yaml)
from mergekit_darts.settings import RunSettings

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


def merge_and_repair(config_source: str, out_path: str, run_merge: Callable, options=None,
                     merge_config=None) -> Optional[dict]:
    """What ``mergekit-yaml`` does with a ``surgery:`` block: validate everything, merge with
    ``run_merge`` (mergekit's), repair ``out_path``. Returns the surgery report, or None for a YAML
    without a surgery block (then this is exactly ``run_merge``)."""
    from mergekit.config import MergeConfiguration
    from mergekit.options import MergeOptions

    from mergekit_darts.preflight import check_before_merge

    options = options or MergeOptions()
    merge_part, surgery = parse_config_source(config_source)
    if merge_config is None:
        merge_config = MergeConfiguration.model_validate(merge_part)
    if surgery is None:
        run_merge(merge_config, out_path, options, config_source)
        return None
    settings = RunSettings.resolve(surgery, options)
    # a typo costs seconds, not a 70B merge
    texts = check_before_merge(surgery, merge_config, settings)
    run_merge(merge_config, out_path, options, config_source)
    if not settings.quiet:
        print(f"mergekit-darts: merge written to {out_path}; running {surgery.method} surgery "
              f"on {len(surgery.domains)} domain(s)", file=sys.stderr)
    try:
        report = repair_directory(out_path, surgery, settings, texts=texts)
    except Exception:
        LOG.error(
            "Surgery failed; %s is left as the plain merged model. Fix the cause and run "
            "`mergekit-darts surgery CONFIG %s` to repair it without merging again.", out_path, out_path,
        )
        raise
    if not settings.quiet:
        for line in summary_lines(report):
            print(f"mergekit-darts: {line}", file=sys.stderr)
    return report


def before_after(values: Optional[dict], label: str, digits: int = 4) -> Optional[str]:
    """``"label a -> b"`` from a {"before"/"mean_before", "after"/"mean_after"} entry, or None."""
    values = values or {}
    before = values.get("mean_before", values.get("before"))
    after = values.get("mean_after", values.get("after"))
    if before is None or after is None:
        return None
    return f"{label} {before:.{digits}f} -> {after:.{digits}f}"


def summary_lines(report: dict) -> List[str]:
    """One line per domain: held-out bias and KL to the expert, before -> after."""
    lines = []
    for name, entry in report["domains"].items():
        split = "held-out" if entry.get("bias_split", "held_out") == "held_out" else "training-set"
        parts = [before_after(entry.get("bias"), f"{split} bias"),
                 before_after(entry.get("held_out_kl"), "KL to expert")]
        lines.append(f"{name}: " + ", ".join(part for part in parts if part))
    return lines


def run_surgery(
    config_source: str, out_path: str, *, overrides: Optional[Dict[str, Any]] = None, options=None,
    progress: Optional[bool] = None,
) -> dict:
    """Surgery only, on an existing merged directory ``out_path``; returns the report."""
    from mergekit_darts.preflight import check_surgery

    _, surgery = parse_config_source(config_source, overrides)
    if surgery is None:
        raise SurgeryConfigError("surgery: the config has no surgery: block")
    if not os.path.isfile(os.path.join(out_path, "config.json")):
        raise SurgeryConfigError(f"{out_path}: not a merged model directory (no config.json); run the merge first")
    settings = RunSettings.resolve(surgery, options, progress)
    texts = check_surgery(surgery, out_path, settings)
    return repair_directory(out_path, surgery, settings, texts=texts)


# ---------------------------------------------------------------------------------------------- steps

def repair_directory(out_path: str, surgery: SurgeryConfig, settings: RunSettings,
                     texts: Optional[Dict[str, List[str]]] = None) -> dict:
    """capture → train each domain → export on a merged directory. Atomic: on failure ``out_path``
    stays a plain merge. ``texts``: each domain's calibration texts as the pre-merge checks loaded them."""
    captured = capture_step(out_path, surgery, settings, texts)
    modules, report = {}, {"surgery": {**surgery.model_dump(exclude={"domains"}), "seed": settings.seed},
                           "domains": {}}
    # a preset's settings as this run resolved them (explicit keys win), for the reader of the report
    report["surgery"]["preset_settings"] = preset_settings(surgery)
    for name, data in captured.domains.items():
        trained = train_domain(name, data, captured.merged_head, surgery, settings)
        modules[name] = trained.module
        report["domains"][name] = trained.entry
        LOG.info("domain %s: held-out bias %.4f -> %.4f", name, trained.entry["bias"]["mean_before"],
                 trained.entry["bias"]["mean_after"])
    export_step(out_path, surgery, modules, report)
    return report


def capture_step(out_path: str, surgery: SurgeryConfig, settings: RunSettings,
                 texts: Optional[Dict[str, List[str]]] = None):
    """Calibration texts (chat template applied) → merged and expert final states of every domain."""
    from transformers import AutoTokenizer

    from mergekit_darts.repair.calibration import apply_chat_template, load_calibration_texts
    from mergekit_darts.repair.capture import DomainCaptureSpec, capture_domains

    tokenizer = AutoTokenizer.from_pretrained(out_path, trust_remote_code=settings.trust_remote_code)
    specs = []
    for name, domain in surgery.domains.items():
        where = f"surgery.domains.{name}.calibration"
        domain_texts = texts[name] if texts is not None else load_calibration_texts(domain.calibration, settings.seed, where)
        if domain.calibration.chat_template:
            domain_texts = apply_chat_template(domain_texts, tokenizer, where=f"{where}.chat_template")
        specs.append(DomainCaptureSpec(name=name, expert=domain.model, texts=domain_texts,
                                       continue_tokens=domain.calibration.continue_tokens,
                                       continue_samples=domain.calibration.continue_samples,
                                       continue_temperature=domain.calibration.continue_temperature,
                                       sample_seed=settings.seed,
                                       add_special_tokens=not domain.calibration.chat_template))
    return capture_domains(
        out_path, specs, surgery.max_positions, dtype=settings.dtype, device=settings.device,
        batch_size=surgery.capture_batch_size, cache_dir=surgery.cache_dir,
        trust_remote_code=settings.trust_remote_code, progress=settings.progress,
    )


@dataclass
class TrainedDomain:
    module: Any  # DomainSurgery, on the CPU, in eval mode
    entry: Dict[str, Any]  # the domain's part of darts_report.json


def split_held_out(n: int, share: float, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(train indices, held-out indices) of ``n`` records; at least one record trains."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    held = int(round(share * n)) if share > 0 and n >= 2 else 0
    held = min(held, n - 1)
    return order[held:].sort().values, order[:held].sort().values


def split_rows(data, surgery: SurgeryConfig, seed: int) -> Dict[str, torch.Tensor]:
    """Row indices {train, validation, held_out} of a captured domain, split by prompt.

    Rows ``[0, prompts)`` are the prompts' greedy (or plain) rows; sampled continuations follow,
    ``data.groups`` naming each row's prompt. The held-out split is the same prompts as without
    samples, and is measured on their greedy rows only, so numbers stay comparable across settings.
    Validation prompts (``surgery.validation`` of the training prompts) are kept only when something
    is chosen with them (``lr_candidates`` / ``early_stopping``)."""
    n_rows = data.merged_hidden.shape[0]
    groups = getattr(data, "groups", None)
    groups = torch.arange(n_rows) if groups is None else groups
    prompts = int(groups.max()) + 1
    train_prompts, held_prompts = split_held_out(prompts, surgery.held_out, seed)
    validation_prompts = train_prompts[:0]
    if surgery.early_stopping or (surgery.lr_candidates and len(surgery.lr_candidates) > 1):
        fit_idx, val_idx = split_held_out(train_prompts.numel(), surgery.validation, seed + 1)
        train_prompts, validation_prompts = train_prompts[fit_idx], train_prompts[val_idx]
    in_train = torch.isin(groups, train_prompts)
    in_validation = torch.isin(groups, validation_prompts) & (torch.arange(n_rows) < prompts)
    in_refit = in_train | torch.isin(groups, validation_prompts)
    return {"train": torch.nonzero(in_train).flatten(), "validation": torch.nonzero(in_validation).flatten(),
            "held_out": held_prompts, "refit": torch.nonzero(in_refit).flatten()}


def train_domain(name: str, data, merged_head: torch.Tensor, surgery: SurgeryConfig,
                 settings: RunSettings) -> TrainedDomain:
    """Train one domain's module on its cached states and measure it on the held-out records."""
    from mergekit_darts.remote_code.surgery import DomainSurgery, SurgeryShape, count_parameters
    from mergekit_darts.repair.capture import resolve_device
    from mergekit_darts.repair.report import bias_by_position
    from mergekit_darts.repair.selection import fit

    started = time.perf_counter()
    device = resolve_device(settings.device)
    kl = surgery.loss == "kl"
    tensors = {
        "merged": data.merged_hidden, "target": data.expert_hidden, "mask": data.attention_mask,
        "position_ids": data.position_ids, "entropy": data.expert_entropy,
    }
    rows = split_rows(data, surgery, settings.seed)
    train_idx, held_idx = rows["train"], rows["held_out"]

    def on_device(index):
        # promote the cached (often bfloat16) states once, not at every step
        part = {k: v[index].to(device) for k, v in tensors.items()}
        part["merged"], part["target"] = part["merged"].float(), part["target"].float()
        return part

    shape = SurgeryShape(method=surgery.method, rank=surgery.rank, head_rank=surgery.head_rank,
                         max_positions=surgery.max_positions, content=surgery.content)
    fitted = fit(
        lambda: DomainSurgery.from_shape(shape, hidden_size=data.merged_hidden.shape[-1],
                                         vocab_size=merged_head.shape[0]),
        on_device(train_idx), on_device(rows["validation"]) if rows["validation"].numel() else None,
        loss=surgery.loss, steps=surgery.steps, lrs=list(surgery.lr_candidates or [surgery.lr]),
        early_stopping=surgery.early_stopping, eval_every=surgery.eval_every, patience=surgery.patience,
        weight_decay=surgery.weight_decay, batch_size=surgery.batch_size, seed=settings.seed,
        expert_head=data.expert_head.to(device, torch.float32) if kl else None,
        merged_head=merged_head.to(device, torch.float32) if kl else None,
        chunk_size=surgery.kl_chunk_size, progress=settings.progress, desc=f"surgery[{name}]",
        refit=on_device(rows["refit"]) if surgery.refit and rows["validation"].numel() else None,
    )
    module, history = fitted.module, fitted.history
    module = module.cpu().eval()
    entry: Dict[str, Any] = {
        "expert": surgery.domains[name].model,
        "calibration": {"train": int(train_idx.numel()), "held_out": int(held_idx.numel()),
                        "validation": int(rows["validation"].numel()),
                        "truncated": int(data.truncated), "skipped": int(data.skipped)},
        "final_loss": history[-1] if history else None,
        "parameters": count_parameters(module),
        "selection": fitted.selection,
        "train_seconds": round(time.perf_counter() - started, 3),
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
    # correction recovers: the quantity that decides generation (docs/design.md §3)
    entry["held_out_kl"] = held_out_kl(module, held, data.expert_head, merged_head, surgery.kl_chunk_size)
    return TrainedDomain(module=module, entry=entry)


@torch.no_grad()
def held_out_kl(module, held, expert_head, merged_head, chunk_size) -> Dict[str, float]:
    """Mean KL(expert || merged) before and after the correction on held-out positions, and the
    share of that gap the correction closes (1 = the expert's distribution, 0 = the plain merge)."""
    from mergekit_darts.repair.losses import kl_loss

    mask = held["mask"].bool()
    merged = held["merged"].float()
    target = held["target"].float()[mask]
    before = kl_loss(merged[mask], target, expert_head, merged_head, chunk_size=chunk_size)
    corrected = module(merged, held["position_ids"])[mask]
    head = module.head_correction if module.head_rank > 0 else None
    after = kl_loss(corrected, target, expert_head, merged_head, head_correction=head, chunk_size=chunk_size)
    gap_closed = 1.0 - float(after) / float(before) if float(before) > 0 else None
    result = {"before": float(before), "after": float(after), "gap_closed": gap_closed}
    if module.position_bias is not None:
        # what `mergekit-darts bake --drop-position-bias` keeps: the correction without its table
        unbiased = (merged - module.content(merged))[mask]
        result["after_without_position_bias"] = float(
            kl_loss(unbiased, target, expert_head, merged_head, head_correction=head, chunk_size=chunk_size))
    return result


def export_step(out_path: str, surgery: SurgeryConfig, modules: Dict[str, Any], report: dict) -> None:
    """The bias plot (best effort) and the atomic export of modules, report and card."""
    from mergekit_darts.output.export import export_surgery
    from mergekit_darts.repair.report import plot_bias

    with tempfile.TemporaryDirectory() as tmp:
        plot_path = os.path.join(tmp, "darts_bias.png")
        extra = {}
        try:
            plot_bias(report, plot_path)
            extra["darts_bias.png"] = plot_path
        except Exception as error:  # a plot must never cost the user their surgery
            LOG.warning("could not draw darts_bias.png: %s", error)
        export_surgery(out_path, modules, {name: d.model for name, d in surgery.domains.items()},
                       surgery.active_domain, loss=surgery.loss, report=report, extra_files=extra)
