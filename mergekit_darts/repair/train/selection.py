"""Training that generalises: early stopping and lr choice on a validation split (docs/quality.md).

The validation records are a share of the *training* prompts (``surgery.validation``), never the
held-out ones the report measures, so the reported held-out KL stays an honest estimate even when
the lr and the stopping step were chosen. Splits are by prompt: every sampled continuation of a
prompt lands on the same side.
"""

import copy
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from mergekit_darts.repair.train.losses import surgery_loss
from mergekit_darts.repair.train.loop import train_surgery

LOG = logging.getLogger(__name__)


@dataclass
class FitResult:
    module: Any  # the trained DomainSurgery (best weights restored when early stopping)
    history: List[float]  # training losses of the chosen run
    selection: Dict[str, Any] = field(default_factory=dict)  # what was chosen, for darts_report.json


@torch.no_grad()
def validation_loss(module, data: Dict[str, torch.Tensor], loss: str, expert_head, merged_head,
                    chunk_size: int) -> float:
    """The training loss of ``module`` on the validation tensors (eval mode, no gradients)."""
    was_training = module.training
    module.eval()
    corrected = module(data["merged"], data["position_ids"])
    value = surgery_loss(
        loss, corrected, data["target"], data["mask"], entropy=data["entropy"],
        expert_head=expert_head, merged_head=merged_head,
        head_correction=module.head_correction if module.head_rank > 0 else None, chunk_size=chunk_size,
    )
    module.train(was_training)
    return float(value)


class EarlyStopping:
    """``on_step`` callback for train_surgery: validation loss every ``every`` steps (and at step 0),
    a copy of the best weights, stop after ``patience`` evaluations without improvement."""

    def __init__(self, evaluate: Callable[[Any], float], every: int, patience: int):
        if every <= 0 or patience <= 0:
            raise ValueError(f"eval_every ({every}) and patience ({patience}) must be positive")
        self.evaluate, self.every, self.patience = evaluate, every, patience
        self.best_loss, self.best_step, self.best_state, self.bad = float("inf"), 0, None, 0
        self.curve: List[List[float]] = []

    def start(self, module) -> None:
        self._record(0, module)

    def _record(self, step: int, module) -> bool:
        value = self.evaluate(module)
        self.curve.append([step, value])
        if value < self.best_loss:
            self.best_loss, self.best_step, self.bad = value, step, 0
            self.best_state = copy.deepcopy(module.state_dict())
        else:
            self.bad += 1
        return self.bad >= self.patience

    def __call__(self, step: int, module) -> bool:
        return step % self.every == 0 and self._record(step, module)

    def finish(self, module, steps_run: int) -> None:
        """Evaluate the last step if it was not, then restore the best weights."""
        if not self.curve or self.curve[-1][0] != steps_run:
            self._record(steps_run, module)
        module.load_state_dict(self.best_state)


def fit(make_module: Callable[[], Any], train_data: Dict[str, torch.Tensor],
        validation: Optional[Dict[str, torch.Tensor]], *, loss: str, steps: int, lrs: Sequence[float],
        early_stopping: bool, eval_every: int, patience: int, weight_decay: float, batch_size, seed: int,
        expert_head, merged_head, chunk_size: int, progress: bool, desc: str, lines: bool = False,
        refit: Optional[Dict[str, torch.Tensor]] = None,
        kl_options: Optional[Dict[str, Any]] = None, micro_batch_size: Optional[int] = None) -> FitResult:
    """Train one module per lr in ``lrs`` (each from the same seeded initialisation) and keep the one
    with the lowest validation loss; with ``early_stopping`` each run keeps its best validation step.
    Without validation data there is nothing to choose with: one run at ``lrs[0]``, all steps.
    ``refit``: the training and validation records together; when given, the chosen lr and step
    count are retrained on them from the same initialisation, so selection costs no training data.
    ``kl_options``: train_surgery's KL-at-scale keywords (kl_target, kl_top_k, ...) for training; the
    validation loss stays the exact one, on few records, so candidates are compared on the true loss."""
    kl_options = dict(kl_options or {})
    if validation is None and (len(lrs) > 1 or early_stopping):
        raise ValueError("lr_candidates / early_stopping need validation records (validation > 0 and "
                         "at least two training prompts)")

    def evaluate(module) -> float:
        return validation_loss(module, validation, loss, expert_head, merged_head, chunk_size)

    def train(module, data, steps_, lr, label, on_step=None):
        return train_surgery(
            module, data["merged"], data["target"], data["mask"], data["position_ids"],
            entropy=data["entropy"], loss=loss, steps=steps_, lr=lr, batch_size=batch_size, seed=seed,
            micro_batch_size=micro_batch_size,
            expert_head=expert_head, merged_head=merged_head, kl_chunk_size=chunk_size,
            progress=progress, lines=lines, desc=f"{desc} {label}", weight_decay=weight_decay, on_step=on_step,
            **kl_options,
        )

    runs = []
    for lr in lrs:
        torch.manual_seed(seed)  # every candidate starts from the same module
        module = make_module()
        stopper = EarlyStopping(evaluate, eval_every, patience) if early_stopping else None
        if stopper is not None:
            stopper.start(module.to(train_data["merged"].device))
        history = train(module, train_data, steps, lr, f"lr={lr:g}", on_step=stopper)
        record: Dict[str, Any] = {"lr": lr, "steps_run": len(history)}
        if stopper is not None:
            stopper.finish(module, len(history))
            record.update(best_step=stopper.best_step, validation_loss=stopper.best_loss)
        elif validation is not None:
            record["validation_loss"] = evaluate(module)
        runs.append((record, module, history))
        LOG.info("%s: lr %g -> %s", desc, lr, record)
    if validation is not None:
        best = min(range(len(runs)), key=lambda i: runs[i][0]["validation_loss"])
    else:
        best = 0
    record, module, history = runs[best]
    selection: Dict[str, Any] = {"lr": record["lr"], "steps": record.get("best_step", record["steps_run"])}
    if validation is not None:
        selection["validation_loss"] = record["validation_loss"]
        selection["candidates"] = [r for r, _, _ in runs]
    if validation is not None and refit is not None:
        torch.manual_seed(seed)
        module = make_module()
        history = train(module, refit, selection["steps"], selection["lr"], "refit")
        selection["refit_records"] = int(refit["merged"].shape[0])
    return FitResult(module=module.eval(), history=history, selection=selection)


def keep_better(trained, start, records: Dict[str, torch.Tensor], *, compared_on: str, start_kind: str,
                selection: Dict[str, Any], loss: str, expert_head, merged_head, chunk_size: int):
    """No regret (docs/quality.md): ``(kept module, record)``, the trained correction or its untrained
    ``start`` (``start_kind``: "data-free extract" or "identity"), whichever has the lower training loss
    on ``records``. On the validation split (``compared_on`` "validation") the trained side is the
    selected run's own validation loss (``selection``), measured before any refit trained on those
    records; elsewhere both are measured here. A tie keeps the start: training bought nothing. With a
    refit the trained correction that ships is the refit one, which trained on the validation records
    and so is never compared itself: the record says so (``refit``; docs/quality.md, "No regret")."""
    start_value = validation_loss(start, records, loss, expert_head, merged_head, chunk_size)
    if compared_on == "validation" and "validation_loss" in selection:
        trained_value = float(selection["validation_loss"])
    else:
        trained_value = validation_loss(trained, records, loss, expert_head, merged_head, chunk_size)
    kept = "trained" if trained_value < start_value else "start"
    record = {"kept": kept, "start": start_kind, "compared_on": compared_on, "records": int(records["merged"].shape[0]),
              "metric": f"{loss} loss", "trained": trained_value, "untrained": start_value,
              "margin": start_value - trained_value}
    if compared_on == "validation" and "refit_records" in selection:
        record["refit"] = True  # "trained" is the selected run before its refit; the refit one was not compared
    LOG.info("no regret: kept the %s (%s loss on %s: trained %.5g, untrained %.5g)",
             "trained correction" if kept == "trained" else f"untrained start ({start_kind})", loss, compared_on,
             trained_value, start_value)
    return (trained if kept == "trained" else start.eval()), record
