"""Training the domain router for the prompts it will see (docs/routing.md, "Training").

From the captured prompt states of each domain's training records:

1. **prefixes**: every record whole plus random prefixes of it (``route.prefix.training_prefixes``),
   pooled as the emitted model pools a prompt of that length;
2. **classifier**: nearest centroid and a logistic-regression probe are both fitted in
   ``folds``-fold cross-validation over the training records and scored on the left-out fold's
   records at 16 / 32 / 64 tokens and whole; the better mean accuracy wins (a tie keeps the
   closed-form centroid), unless ``router_kind`` names one;
3. **gate**: the confidence threshold is conformal: for each domain and each measured prompt
   length, the ``floor(rate * (n + 1))``-th lowest out-of-fold confidence of the domain's own
   records cut to that length, so that at most ``rate`` of them are expected to fall back to
   ``none``; the lowest of these thresholds is kept (every domain, at every length, within the
   rate). An explicit ``router_threshold`` is used as given.

The router is then fitted on all training records and measured on the surgery's held-out records
(never used above) at each prefix length. Nothing here changes the shipped router's math: only its
weight, bias, centroids, similarity statistics and threshold are chosen.
"""

import logging
import math
from typing import Dict, List, Optional, Tuple

import torch

from mergekit_darts.remote_code.routing import NO_ROUTE, DomainRouter
from mergekit_darts.repair.route.router import DEFAULT_THRESHOLD, NONE_LABEL, fit_router
from mergekit_darts.repair.route.prefix import (PREFIX_LENGTHS, TRAIN_PREFIXES, PromptStates, pool_prefixes,
                                                 pooled_at, prefix_label, shared_prefix_length, training_prefixes)

LOG = logging.getLogger(__name__)

KINDS = ("centroid", "logistic")  # order = preference on a tie
DEFAULT_FALLBACK_RATE = 0.05
FOLDS = 5
LABELS = [prefix_label(n) for n in PREFIX_LENGTHS]


class Pooled:
    """A domain's states pooled once: training prefixes (with their record) and measured prefixes."""

    def __init__(self, states: PromptStates, generator: torch.Generator, shared: int = 0):
        self.records = states.records
        rows, lengths = training_prefixes(states, generator, TRAIN_PREFIXES, shared=shared)
        self.train_rows, self.train = rows, pool_prefixes(states, rows, lengths)
        self.measured = pooled_at(states, shared=shared)

    def training(self, records: torch.Tensor) -> torch.Tensor:
        return self.train[torch.isin(self.train_rows, records)]


def _fit(pooled: Dict[str, Pooled], records: Dict[str, torch.Tensor], kind: str, threshold: float) -> DomainRouter:
    return fit_router({name: p.training(records[name]) for name, p in pooled.items()}, kind=kind, threshold=threshold)


def _folds(n: int, folds: int, seed: int) -> torch.Tensor:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    assignment = torch.empty(n, dtype=torch.long)
    assignment[order] = torch.arange(n) % folds
    return assignment


def cross_validate(pooled: Dict[str, Pooled], kinds, folds: int, seed: int) -> Dict[str, dict]:
    """{kind: {domain: {label: (chosen [N], confidence [N])}}} out of fold, before any threshold."""
    assignment = {name: _folds(p.records, folds, seed + i) for i, (name, p) in enumerate(pooled.items())}
    out = {kind: {name: {label: (torch.zeros(p.records, dtype=torch.long), torch.zeros(p.records))
                         for label in LABELS} for name, p in pooled.items()} for kind in kinds}
    for fold in range(folds):
        fitting = {name: torch.nonzero(a != fold).flatten() for name, a in assignment.items()}
        for kind in kinds:
            router = _fit(pooled, fitting, kind, threshold=0.0)
            for name, p in pooled.items():
                held = torch.nonzero(assignment[name] == fold).flatten()
                for label in LABELS:
                    chosen, confidence = router.scores(p.measured[label][held])
                    out[kind][name][label][0][held] = chosen
                    out[kind][name][label][1][held] = confidence
    return out


def conformal_threshold(confidences: torch.Tensor, rate: float) -> float:
    """The ``floor(rate * (n + 1))``-th lowest confidence (0 when that is below the first): a new
    exchangeable in-domain prompt is below it with probability at most ``rate``."""
    k = math.floor(rate * (confidences.numel() + 1))
    return 0.0 if k < 1 else float(confidences.sort().values[k - 1])


def _selection(oof: Dict[str, dict], domains: List[str]) -> Dict[str, Dict[str, float]]:
    """{kind: {label: macro accuracy, "mean": over labels}} of the out-of-fold choices (no gate)."""
    table = {}
    for kind, per_domain in oof.items():
        scores = {label: sum(float((per_domain[name][label][0] == i).float().mean()) for i, name in enumerate(domains))
                  / len(domains) for label in LABELS}
        table[kind] = {**scores, "mean": sum(scores.values()) / len(scores)}
    return table


def _routed(router: DomainRouter, pooled: torch.Tensor) -> List[int]:
    return router.route(pooled).tolist() if pooled.shape[0] else []


def confusion_at(router: DomainRouter, pooled: Dict[str, torch.Tensor]) -> Dict[str, Dict[str, int]]:
    labels = [*router.domains, NONE_LABEL]
    return {name: {label: sum(1 for r in _routed(router, rows) if labels[r] == label) for label in labels}
            for name, rows in pooled.items()}


def _table_summary(table: Dict[str, Dict[str, int]]) -> dict:
    totals = {name: sum(row.values()) for name, row in table.items()}
    everything = sum(totals.values())
    return {
        "accuracy": {name: (row.get(name, 0) / totals[name] if totals[name] else None) for name, row in table.items()},
        "none_share": {name: (row.get(NONE_LABEL, 0) / totals[name] if totals[name] else None)
                       for name, row in table.items()},
        "mean_accuracy": sum(row.get(name, 0) for name, row in table.items()) / everything if everything else None,
        "confusion": table,
    }


def by_prefix(router: DomainRouter, measured: Dict[str, Dict[str, torch.Tensor]]) -> Dict[str, dict]:
    """{label: accuracy / none_share / mean_accuracy / confusion} over {domain: {label: pooled}}."""
    return {label: _table_summary(confusion_at(router, {name: rows[label] for name, rows in measured.items()}))
            for label in LABELS}


def _none_shares(router: DomainRouter, measured: Dict[str, torch.Tensor]) -> Dict[str, Optional[float]]:
    return {label: (float((router.route(rows) == NO_ROUTE).float().mean()) if rows.shape[0] else None)
            for label, rows in measured.items()}


def swapped_fallback(pooled: Dict[str, Pooled], records: Dict[str, torch.Tensor], kind: str,
                     threshold: float) -> Optional[Dict[str, Dict[str, Optional[float]]]]:
    """Leave one domain out: a router fitted on the other domains routes every record of the left-out
    one; {domain: {label: share sent to none}}. None with a single domain."""
    if len(pooled) < 2:
        return None
    shares = {}
    for name, p in pooled.items():
        others = {o: q for o, q in pooled.items() if o != name}
        router = _fit(others, {o: records[o] for o in others}, kind, threshold)
        shares[name] = _none_shares(router, p.measured)
    return shares


def train_router(states: Dict[str, PromptStates], splits: Dict[str, Tuple[torch.Tensor, torch.Tensor]], *,
                 threshold: Optional[float] = None, fallback_rate: float = DEFAULT_FALLBACK_RATE,
                 kind: str = "auto", seed: int = 0, folds: int = FOLDS,
                 eval_states: Optional[PromptStates] = None, reads: str = "final") -> Tuple[DomainRouter, dict]:
    """Fit, select, calibrate and measure the router (module docstring); returns (router, report entry).

    ``splits``: {domain: (train records, held-out records)} (the surgery's split). ``threshold``:
    an explicit gate (None: conformal at ``fallback_rate``). ``eval_states``: ``router_eval``
    prompts (out of domain), else the fallback is measured on swapped domains. ``reads``: which states
    ``states`` are (the router's ``states``: "final" or "block_input"), written into its settings."""
    names = list(states)
    generator = torch.Generator().manual_seed(seed)
    shared = shared_prefix_length(list(states.values()))  # a chat template: prefixes count after it
    pooled = {name: Pooled(s, generator, shared) for name, s in states.items()}
    train = {name: splits[name][0] for name in names}
    smallest = min(int(rows.numel()) for rows in train.values())
    folds = min(folds, smallest)
    kinds = list(KINDS) if kind == "auto" else [kind]
    calibration: dict = {"prefix_lengths": LABELS, "train_prefixes": TRAIN_PREFIXES, "shared_prefix_tokens": shared}
    if folds >= 2:
        restricted = {name: _restrict(p, train[name]) for name, p in pooled.items()}
        oof = cross_validate(restricted, kinds, folds, seed)
        selection = _selection(oof, names)
        chosen_kind = max(kinds, key=lambda k: (round(selection[k]["mean"], 9), -kinds.index(k)))
        confidences = {name: {label: oof[chosen_kind][name][label][1] for label in LABELS} for name in names}
        per_prefix = {name: {label: conformal_threshold(c, fallback_rate) for label, c in by_label.items()}
                      for name, by_label in confidences.items()}
        calibration.update(folds=folds, selection=selection)
        if threshold is None:
            threshold = min(t for by_label in per_prefix.values() for t in by_label.values())
            calibration.update(threshold="conformal", fallback_rate=fallback_rate, per_prefix_threshold=per_prefix)
        else:
            calibration["threshold"] = "explicit"
        calibration["out_of_fold_none_share"] = {
            name: {label: float(c.lt(threshold).float().mean()) for label, c in by_label.items()}
            for name, by_label in confidences.items()}
    else:  # a domain with one training record: nothing to cross-validate on
        chosen_kind = "centroid" if kind == "auto" else kind
        calibration["threshold"] = "explicit" if threshold is not None else "default (too few records to calibrate)"
        threshold = DEFAULT_THRESHOLD if threshold is None else threshold
    router = _fit(pooled, train, chosen_kind, float(min(max(threshold, 0.0), 1.0)))
    router.states = reads

    held_everywhere = all(splits[name][1].numel() for name in names)
    split = "held_out" if held_everywhere else "train"
    measured_records = {name: splits[name][1] if held_everywhere else train[name] for name in names}
    measured = {name: {label: pooled[name].measured[label][measured_records[name]] for label in LABELS} for name in names}
    prefixes = by_prefix(router, measured)
    whole = prefixes["all"]
    entry = {**router.to_meta(), "split": split,
             "records": {name: int(r.numel()) for name, r in measured_records.items()},
             "accuracy": whole["accuracy"], "mean_accuracy": whole["mean_accuracy"], "confusion": whole["confusion"],
             "by_prefix": prefixes, "calibration": calibration}
    if eval_states is not None:
        # its own template when it has one (the same as the training prompts'), else from its first token
        eval_shared = min(shared, shared_prefix_length([eval_states]))
        shares = _none_shares(router, pooled_at(eval_states, shared=eval_shared))
        entry["out_of_domain"] = {"source": "router_eval", "records": eval_states.records,
                                  "none_share": shares["all"], "by_prefix": shares}
    else:
        every = {name: torch.arange(p.records) for name, p in pooled.items()}
        swapped = swapped_fallback(pooled, {name: train[name] for name in names}, chosen_kind, router.threshold)
        if swapped is not None:
            means = {label: _mean([s[label] for s in swapped.values()]) for label in LABELS}
            entry["out_of_domain"] = {"source": "swapped_domains", "records": {n: int(r.numel()) for n, r in every.items()},
                                      "by_domain": {name: s["all"] for name, s in swapped.items()},
                                      "none_share": means["all"], "by_prefix": means}
    LOG.info("router: %s (%s, threshold %.4g) %s accuracy by prefix %s", chosen_kind, calibration["threshold"],
             router.threshold, split, {label: _round(prefixes[label]["mean_accuracy"]) for label in LABELS})
    return router, entry


def _restrict(pooled: Pooled, records: torch.Tensor) -> Pooled:
    """The same pooled domain seen through its training records only (renumbered 0..n-1)."""
    view = Pooled.__new__(Pooled)
    view.records = int(records.numel())
    keep = torch.isin(pooled.train_rows, records)
    view.train_rows = torch.searchsorted(records, pooled.train_rows[keep])
    view.train = pooled.train[keep]
    view.measured = {label: rows[records] for label, rows in pooled.measured.items()}
    return view


def _mean(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _round(value) -> Optional[float]:
    return None if value is None else round(value, 3)
