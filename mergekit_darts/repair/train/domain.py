"""Train one domain's correction on its cached states and measure it on held-out records
(docs/design.md §3, docs/quality.md)."""

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from mergekit_darts.config import SurgeryConfig, SurgeryConfigError
from mergekit_darts.errors import DeviceError
from mergekit_darts.repair.train.split import split_rows
from mergekit_darts.settings import RunSettings


def check_finite_training(name: str, module, corrected: torch.Tensor, surgery: SurgeryConfig) -> None:
    """A diverged correction is never exported (it would load, and generate garbage)."""
    bad = [key for key, value in module.state_dict().items() if not bool(torch.isfinite(value).all())]
    if bad or not bool(torch.isfinite(corrected).all()):
        what = f"non-finite parameters {bad}" if bad else "non-finite corrected states"
        raise SurgeryConfigError(
            f"surgery.domains.{name}: training diverged ({what}); lower surgery.lr (now {surgery.lr:g}) "
            "or surgery.steps"
        )


def held_out_objective(loss: str, held: Dict[str, torch.Tensor], corrected: torch.Tensor) -> Dict[str, float]:
    """The training loss itself on the held-out records, plain merge vs corrected: what the verdict is
    decided on for hidden-state losses (report.verdict.verdict_metrics; ``kl`` uses held_out_kl)."""
    from mergekit_darts.repair.train.losses import surgery_loss

    target, mask, entropy = held["target"].float(), held["mask"], held["entropy"]
    before = surgery_loss(loss, held["merged"].float(), target, mask, entropy=entropy)
    after = surgery_loss(loss, corrected.float(), target, mask, entropy=entropy)
    return {"before": float(before), "after": float(after)}


@contextmanager
def memory_advice(name: str, surgery: SurgeryConfig):
    """A GPU out of memory while training ``name`` becomes one line saying which setting lowers the
    memory without changing what is trained (micro_batch_size), not a CUDA traceback."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as error:
        micro = surgery.micro_batch_size
        if micro is None:
            advice = ("set surgery.micro_batch_size (e.g. 4: each step runs 4 sequences at a time and sums their "
                      "gradients, the same training in less memory)")
        elif micro > 1:
            advice = f"lower surgery.micro_batch_size (now {micro})"
        else:
            advice = "micro_batch_size is already 1: lower max_positions or depth, or use a larger GPU"
        raise DeviceError(f"surgery.domains.{name}: the GPU ran out of memory while training; {advice} "
                          "(docs/scale.md)") from error


@dataclass
class TrainedDomain:
    module: Any  # DomainSurgery, on the CPU, in eval mode
    entry: Dict[str, Any]  # the domain's part of darts_report.json


def train_domain(name: str, data, merged_head: torch.Tensor, surgery: SurgeryConfig,
                 settings: RunSettings, tail=None, merged_dir: Optional[str] = None) -> TrainedDomain:
    """Train one domain's module on its cached states and measure it on the held-out records.
    ``tail`` (``depth > 0``): the frozen last blocks; the module then reads ``data.block_inputs``, or
    with ``train_blocks: k`` the input of the first of the last ``k`` blocks, computed once with the
    extract's adapters on the blocks below (train/top_blocks.py), and runs only those ``k``.
    ``merged_dir``: the merge's weights, for the data-free extract (expert − merge) that
    ``adapter_init: delta`` starts from and the report's ``baseline`` measures."""
    from mergekit_darts.remote_code.surgery import DomainSurgery, SurgeryShape, count_parameters
    from mergekit_darts.repair.capture.context import resolve_device
    from mergekit_darts.repair.report.behaviour import domain_behaviour
    from mergekit_darts.repair.report.measure import bias_by_position, held_out_kl
    from mergekit_darts.repair.report.verdict import domain_verdict
    from mergekit_darts.repair.train.selection import fit, keep_better
    from mergekit_darts.repair.train.delta_init import extract_start, start_from_deltas
    from mergekit_darts.repair.train.tail import TailSurgery
    from mergekit_darts.repair.train import top_blocks

    started = time.perf_counter()
    device = resolve_device(settings.device)
    kl = surgery.loss == "kl"
    shape = SurgeryShape.from_config(surgery)
    rows = split_rows(data, surgery, settings.seed)
    train_idx, held_idx = rows["train"], rows["held_out"]
    grams = None
    if surgery.extract_fit == "activations":  # the merge's inputs of each adapted linear, training records only
        from mergekit_darts.repair.train.activation_fit import LayerInputs, head_whitening

        grams = (LayerInputs(tail, data.block_inputs, data.position_ids, data.attention_mask, train_idx,
                             surgery.micro_batch_size or surgery.capture_batch_size, device) if tail is not None else None,
                 head_whitening(data.merged_hidden, data.attention_mask, train_idx) if surgery.head_rank > 0 else None)
    deltas, not_measured = extract_start(name, surgery, settings, tail, merged_dir, device, grams)
    # what the module reads: the final states, or with depth the first adapted block's input
    inputs = data.block_inputs if tail is not None else data.merged_hidden
    prefixes = getattr(data, "prefixes", None)  # the behaviour figures' held-out prefixes, read the same way
    prefix_inputs = None if prefixes is None else prefixes.block_inputs if tail is not None else prefixes.merged_hidden
    top = top_blocks.trained_blocks(surgery, tail)  # train_blocks: only the last `top` adapted blocks train
    run_tail = tail  # the blocks a step runs

    def make_module(from_deltas: bool = surgery.adapter_init == "delta"):
        module = DomainSurgery.from_shape(shape, hidden_size=data.merged_hidden.shape[-1],
                                          vocab_size=merged_head.shape[0],
                                          block_targets=tail.targets if tail is not None else None)
        if from_deltas:
            start_from_deltas(module, deltas)
        if top is not None:  # the blocks below the trained ones keep the extract
            top_blocks.freeze_below(module, tail.first + len(tail.layers) - top)
        return TailSurgery(run_tail, module.to(device)) if tail is not None else module

    if top is not None:  # their output, the first trained block's input, once per record (and prefix)
        lower, run_tail = top_blocks.split_tail(tail, top)
        with torch.random.fork_rng(devices=[]):
            extract = make_module().surgery
        batch = surgery.micro_batch_size or surgery.capture_batch_size
        inputs = top_blocks.first_trained_inputs(lower, extract, inputs, data.position_ids, batch, device)
        if prefix_inputs is not None:
            prefix_inputs = top_blocks.first_trained_inputs(lower, extract, prefix_inputs, prefixes.position_ids,
                                                            batch, device)
        del extract
    tensors = {
        "merged": inputs, "target": data.expert_hidden, "mask": data.attention_mask,
        "position_ids": data.position_ids, "entropy": data.expert_entropy,
    }

    def on_device(index):
        # promote the cached (often bfloat16) states once, not at every step
        part = {k: v[index].to(device) for k, v in tensors.items()}
        part["merged"], part["target"] = part["merged"].float(), part["target"].float()
        return part

    with memory_advice(name, surgery):
        fitted = fit(
            make_module,
            on_device(train_idx), on_device(rows["validation"]) if rows["validation"].numel() else None,
            loss=surgery.loss, steps=surgery.steps, lrs=list(surgery.lr_candidates or [surgery.lr]),
            early_stopping=surgery.early_stopping, eval_every=surgery.eval_every, patience=surgery.patience,
            weight_decay=surgery.weight_decay, batch_size=surgery.batch_size, micro_batch_size=surgery.micro_batch_size,
            seed=settings.seed,
            expert_head=data.expert_head.to(device, torch.float32) if kl else None,
            merged_head=merged_head.to(device, torch.float32) if kl else None,
            chunk_size=surgery.kl_chunk_size, progress=settings.progress, lines=settings.stage_lines, desc=f"surgery[{name}]",
            refit=on_device(rows["refit"]) if surgery.refit and rows["validation"].numel() else None,
            kl_options={"kl_target": surgery.kl_target, "kl_top_k": surgery.kl_top_k,
                        "kl_precision": surgery.kl_precision, "kl_positions_per_step": surgery.kl_positions_per_step},
        )
    history = fitted.history
    measured = fitted.module.eval()  # what the held-out numbers are measured with (with depth: tail + surgery)
    no_regret, rejected = None, None
    if surgery.no_regret:  # the untrained start ships when training did not beat it (docs/quality.md)
        check_finite_training(name, measured.surgery if tail is not None else measured, torch.zeros(0), surgery)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(settings.seed)  # the very start fit trained from
            start = make_module().to(device)
        compared_on, index = comparison_records(rows)
        kept, no_regret = keep_better(
            measured, start, on_device(index), compared_on=compared_on, selection=fitted.selection,
            start_kind="data-free extract" if surgery.adapter_init == "delta" else "identity", loss=surgery.loss,
            expert_head=data.expert_head.to(device, torch.float32) if kl else None,
            merged_head=merged_head.to(device, torch.float32) if kl else None, chunk_size=surgery.kl_chunk_size)
        rejected, measured = (measured if kept is start else start), kept
    module = measured.surgery if tail is not None else measured  # what is exported
    entry: Dict[str, Any] = {
        "expert": surgery.domains[name].model,
        "calibration": {"train": int(train_idx.numel()), "held_out": int(held_idx.numel()),
                        "validation": int(rows["validation"].numel()),
                        "truncated": int(data.truncated), "skipped": int(data.skipped),
                        **({"synthesis": data.synthesis} if getattr(data, "synthesis", None) else {})},
        "final_loss": history[-1] if history else None,
        "parameters": count_parameters(module),
        "selection": fitted.selection,
        "train_seconds": round(time.perf_counter() - started, 3),
    }
    if top is not None:  # which blocks trained and which keep the extract
        entry["blocks"] = top_blocks.blocks_entry(tail, top, module)
    eval_idx = held_idx if held_idx.numel() else train_idx
    entry["bias_split"] = "held_out" if held_idx.numel() else "train"
    held = {k: v[eval_idx] for k, v in tensors.items()}
    held["input"], held["merged"] = held["merged"], data.merged_hidden[eval_idx]
    with torch.no_grad():
        corrected = measured(held["input"].float().to(device), held["position_ids"].to(device)).cpu()
    check_finite_training(name, module, corrected, surgery)
    entry["bias"] = bias_by_position(
        held["merged"].float(), held["target"].float(), held["mask"], held["position_ids"],
        held["entropy"], corrected, max_positions=surgery.max_positions,
    )
    # whatever the training loss, report how much of the expert's next-token distribution the
    # correction recovers: the quantity that decides generation (docs/design.md §3)
    entry["held_out_kl"] = held_out_kl(measured, {k: v.to(device) for k, v in held.items()},
                                       data.expert_head.to(device), merged_head.to(device), surgery.kl_chunk_size)
    if not kl:
        entry["held_out_loss"] = held_out_objective(surgery.loss, held, corrected)
    if no_regret is not None:  # what the one not shipped gives on the report's records
        no_regret["other_held_out_kl"] = held_out_kl(rejected, {k: v.to(device) for k, v in held.items()},
                                                     data.expert_head.to(device), merged_head.to(device),
                                                     surgery.kl_chunk_size)["after"]
        entry["no_regret"] = no_regret
    prefix_corrected = corrected_prefixes(measured, prefix_inputs, prefixes, device)
    module.cpu()  # the greedy-agreement figures on the cpu, where the cached states are
    entry["behaviour"] = domain_behaviour(data, eval_idx, corrected, module, merged_head.cpu(),
                                          surgery.domains[name].calibration.continue_tokens,
                                          surgery.max_positions, surgery.kl_chunk_size, prefix_corrected)
    entry["verdict"] = domain_verdict(entry, surgery.loss)
    if deltas is not None:  # what the same adapters give untrained, straight from the weights
        entry["baseline"] = measure_extract(make_module(from_deltas=True).eval(), deltas, data, eval_idx, held,
                                            merged_head, surgery, surgery.domains[name].calibration.continue_tokens,
                                            device, prefix_inputs)
    else:
        entry["baseline"] = {"not_measured": not_measured}
    # train_seconds + measure_seconds: the run's `train:<name>` stage (the report table says so)
    entry["measure_seconds"] = round(time.perf_counter() - started - entry["train_seconds"], 3)
    return TrainedDomain(module=module, entry=entry)


def comparison_records(rows: Dict[str, torch.Tensor]):
    """(what the no-regret comparison is made on, its row indices): the validation split when one was
    kept; else the held-out records — the report's own, which the report then says; else (held_out: 0)
    the training records."""
    for split in ("validation", "held_out"):
        if rows[split].numel():
            return split, rows[split]
    return "train", rows["train"]


def corrected_prefixes(measured, inputs: Optional[torch.Tensor], prefixes, device) -> Optional[torch.Tensor]:
    """The corrected states of ``prefixes`` (held-out records cut to leave room for a continuation,
    capture/prefixes.py) from ``inputs``, what the module reads of them; None when the capture has none."""
    if inputs is None:
        return None
    with torch.no_grad():
        return measured(inputs.float().to(device), prefixes.position_ids.to(device)).cpu()


def measure_extract(extract, deltas, data, eval_idx, held, merged_head, surgery, continue_tokens: int,
                    device, prefix_inputs: Optional[torch.Tensor] = None) -> Dict[str, Any]:
    """The report's ``baseline``: the untrained delta-initialised module (the block adapters and head
    correction as ``mergekit-extract-lora`` would extract them, the final-state correction the identity)
    measured on the same held-out records (``held["input"]``, ``prefix_inputs``: what the trained one read) as
    the trained one."""
    from mergekit_darts.repair.report.behaviour import domain_behaviour
    from mergekit_darts.repair.report.measure import held_out_kl

    started = time.perf_counter()
    with torch.no_grad():
        corrected = extract(held["input"].float().to(device), held["position_ids"].to(device)).cpu()
    kl = held_out_kl(extract, {k: v.to(device) for k, v in held.items()}, data.expert_head.to(device),
                     merged_head.to(device), surgery.kl_chunk_size)
    prefix_corrected = corrected_prefixes(extract, prefix_inputs, getattr(data, "prefixes", None), device)
    surgery_module = (extract.surgery if hasattr(extract, "surgery") else extract).cpu()
    behaviour = domain_behaviour(data, eval_idx, corrected, surgery_module, merged_head.cpu(), continue_tokens,
                                 surgery.max_positions, surgery.kl_chunk_size, prefix_corrected)
    return {"kind": "data-free extract (truncated SVD of expert − merge)", **deltas.describe(),
            "held_out_kl": kl, "behaviour": behaviour, "seconds": round(time.perf_counter() - started, 3)}
