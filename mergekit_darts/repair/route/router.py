"""Training and measuring the domain router (docs/routing.md) from the capture's prompt states.

The router sees what the emitted model sees at prefill: the merged model's final-norm outputs (with
``depth: k``, the input of the first adapted block; the pipeline passes those states in) over the
prompt tokens only (``CapturedDomain.prompt_lengths``; a continued calibration sample's answer
tokens are left out), pooled by ``remote_code.routing.pool_prompt_states``. Fitting is closed-form
(nearest centroid) or a few hundred full-batch L-BFGS steps (logistic regression): seconds on CPU,
deterministic for a given input. What it is fitted on (prompt prefixes), which classifier is kept
and where the gate sits are chosen in ``route.train``.
"""

import logging
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from mergekit_darts.console import few_records_note, routing_accuracy
from mergekit_darts.remote_code.routing import NO_ROUTE, DomainRouter, pool_prompt_states

LOG = logging.getLogger(__name__)

DEFAULT_KIND = "centroid"
# The gate used when it cannot be calibrated (a domain with a single training record); otherwise the
# threshold is conformal (route.train) or the user's router_threshold.
DEFAULT_THRESHOLD = 0.02
_STD_FLOOR = 1e-3  # a domain with one training record (std 0) would reject everything else
NONE_LABEL = "none"
_SMALL_PROBLEM = 1 << 22  # features (rows x hidden) below which the logistic fit runs on one thread


def prompt_mask(data) -> torch.Tensor:
    """[N, T] bool: the real tokens of each record's prompt (not its continuation)."""
    columns = torch.arange(data.attention_mask.shape[1]).unsqueeze(0)
    return data.attention_mask.bool() & (columns < data.prompt_lengths.unsqueeze(1))


def pooled_prompts(data, batch_size: int = 256) -> torch.Tensor:
    """[N, H] pooled merged-model prompt states of one captured domain (float32, unit rows)."""
    mask = prompt_mask(data)
    return torch.cat([pool_prompt_states(data.merged_hidden[i:i + batch_size], mask[i:i + batch_size])
                      for i in range(0, mask.shape[0], batch_size)])


def _similarity_stats(router: DomainRouter, pooled: Dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for index, name in enumerate(router.domains):
            centroid = torch.nn.functional.normalize(pooled[name].mean(dim=0), dim=0)
            similarity = pooled[name] @ centroid
            router.centroids[index] = centroid
            router.similarity_mean[index] = similarity.mean()
            router.similarity_std[index] = similarity.std(unbiased=False).clamp_min(_STD_FLOOR)


def _logistic(features: torch.Tensor, labels: torch.Tensor, classes: int, steps: int,
              weight_decay: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Multinomial logistic regression on standardised features; returns (weight, bias) for the raw
    features (the standardisation folded in)."""
    mean, std = features.mean(dim=0), features.std(dim=0, unbiased=False).clamp_min(1e-6)
    x = (features - mean) / std
    weight = torch.zeros(classes, x.shape[1], requires_grad=True)
    bias = torch.zeros(classes, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], lr=1.0, max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ weight.t() + bias, labels)
        loss = loss + weight_decay * weight.pow(2).sum()
        loss.backward()
        return loss

    threads = torch.get_num_threads()
    if x.numel() < _SMALL_PROBLEM:  # tiny matmuls: a second thread only spin-waits (slower on a busy CPU)
        torch.set_num_threads(1)
    try:
        optimizer.step(closure)
    finally:
        torch.set_num_threads(threads)
    folded = weight.detach() / std
    return folded, bias.detach() - folded @ mean


def fit_router(pooled: Dict[str, torch.Tensor], kind: str = DEFAULT_KIND, threshold: float = DEFAULT_THRESHOLD,
               steps: int = 200, weight_decay: float = 1e-3) -> DomainRouter:
    """A router over the domains of ``pooled`` ({domain: [N_d, H] pooled training prompts}, order kept)."""
    names = list(pooled)
    empty = [name for name in names if pooled[name].shape[0] == 0]
    if not names or empty:
        raise ValueError(f"pooled: every domain needs at least one training prompt (empty: {empty})")
    router = DomainRouter(pooled[names[0]].shape[1], names, threshold=threshold, kind=kind)
    pooled = {name: rows.float() for name, rows in pooled.items()}
    _similarity_stats(router, pooled)
    with torch.no_grad():
        if kind == "centroid" or len(names) == 1:
            router.weight.copy_(router.centroids)
            router.bias.zero_()
        else:
            features = torch.cat([pooled[name] for name in names])
            labels = torch.cat([torch.full((pooled[name].shape[0],), i, dtype=torch.long)
                                for i, name in enumerate(names)])
            with torch.enable_grad():
                weight, bias = _logistic(features, labels, len(names), steps, weight_decay)
            router.weight.copy_(weight)
            router.bias.copy_(bias)
    return router.eval()


@torch.no_grad()
def route_pooled(router: DomainRouter, pooled: torch.Tensor) -> torch.Tensor:
    """Domain index per row (-1 = none) of already pooled prompts."""
    return router.route(pooled)


def confusion(router: DomainRouter, pooled: Dict[str, torch.Tensor]) -> Dict[str, Dict[str, int]]:
    """{true domain: {routed domain or "none": count}} over the rows of ``pooled``."""
    labels = [*router.domains, NONE_LABEL]
    table = {}
    for name, rows in pooled.items():
        routed = route_pooled(router, rows).tolist() if rows.shape[0] else []
        table[name] = {label: sum(1 for r in routed if labels[r] == label) for label in labels}
    return table


def accuracy(table: Dict[str, Dict[str, int]]) -> Dict[str, Optional[float]]:
    """Share of each domain's rows routed to that domain ("none" counts as wrong)."""
    return {name: (row.get(name, 0) / sum(row.values()) if sum(row.values()) else None) for name, row in table.items()}


def none_share(router: DomainRouter, pooled: torch.Tensor) -> Optional[float]:
    if pooled.shape[0] == 0:
        return None
    return float((route_pooled(router, pooled) == NO_ROUTE).float().mean())


def summary_lines(entry: dict) -> List[str]:
    """Console lines for the pipeline summary: the whole-prompt accuracy and confusion, then the
    accuracy and fallback at each measured prefix length, then the out-of-domain fallback."""
    accuracies = routing_accuracy(entry)
    split = "held-out" if entry.get("split") == "held_out" else "training-set"
    how = (entry.get("calibration") or {}).get("threshold")
    gate = f"threshold {entry.get('threshold'):.4g}" + (f" ({how})" if how else "")
    lines = [f"router ({entry.get('kind')}, {gate}): {split} routing accuracy {accuracies}"]
    labels: Sequence[str] = [*entry.get("domains", []), NONE_LABEL]
    for name, row in entry.get("confusion", {}).items():
        lines.append(f"router confusion {name}: " + " ".join(f"{label}={row.get(label, 0)}" for label in labels))
    prefixes = entry.get("by_prefix") or {}
    if prefixes:
        cells = []
        for label, summary in prefixes.items():
            right = "/".join(_pct(v) for v in summary["accuracy"].values())
            none = "/".join(_pct(v) for v in summary["none_share"].values())
            cells.append(f"{label}: {right} (none {none})")
        order = "/".join(entry.get("domains", []))
        lines.append(f"router by prompt length in tokens ({order}): " + "; ".join(cells))
    ood = entry.get("out_of_domain")
    if ood and ood.get("none_share") is not None:
        what = "router_eval texts" if ood["source"] == "router_eval" else "left-out domains (swapped)"
        lines.append(f"router: {100 * ood['none_share']:.1f}% of out-of-domain prompts ({what}) fall back to none")
    note = few_records_note(entry)
    return lines + ([note] if note else [])


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"
