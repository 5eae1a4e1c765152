"""Verdicts on a report: did a domain's correction beat the plain merge, which domain the output loads
with, and the report made JSON-safe (non-finite numbers named, never written)."""

import math
from typing import Any, Dict, List, Optional, Tuple


def verdict_metrics(entry: Dict[str, Any], loss: str) -> List[Tuple[str, Any, Any]]:
    """(label, before, after) of every held-out metric a verdict looks at; the first decides. It is the
    training objective's own value on the held-out records (the KL to the expert for ``kl``, else the
    ``loss`` itself, ``held_out_loss``), so the verdict and the default domain agree with what the run
    optimised; the others are reported where they disagree. A new metric (e.g. a behaviour measure)
    goes in here, first where it should decide."""
    kl = entry.get("held_out_kl") or {}
    bias = entry.get("bias") or {}
    objective = entry.get("held_out_loss") or {}
    kl_metric = ("KL to expert", kl.get("before"), kl.get("after"))
    if loss == "kl":
        metrics = [kl_metric]
    elif objective:
        metrics = [(f"{loss} loss", objective.get("before"), objective.get("after")), kl_metric]
    elif loss.startswith("ew"):  # a report written before held_out_loss existed
        metrics = [("entropy-weighted bias", bias.get("mean_before_weighted"), bias.get("mean_after_weighted")), kl_metric]
    else:
        metrics = [("bias", bias.get("mean_before"), bias.get("mean_after")), kl_metric]
    return [metric for metric in metrics if metric[1] is not None or metric is metrics[0]]


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _status(before: Any, after: Any) -> str:
    if not (_finite(before) and _finite(after)):
        return "non_finite"
    if after == before:  # an exact tie (steps: 0 from the identity): nothing the correction did counts
        return "unchanged"
    return "worse" if after > before else "improved"


def measured_figures(entry: Dict[str, Any]) -> List[Tuple[str, Any, Any, bool]]:
    """(label, before, after, higher is better) of every held-out figure the report measures: the KL to
    the expert, the L1 and entropy-weighted L1 bias, and the behaviour figures where they were measured."""
    kl, bias = entry.get("held_out_kl") or {}, entry.get("bias") or {}
    figures = [("KL to expert", kl.get("before"), kl.get("after"), False),
               ("L1 bias", bias.get("mean_before"), bias.get("mean_after"), False),
               ("entropy-weighted L1 bias", bias.get("mean_before_weighted"), bias.get("mean_after_weighted"), False)]
    behaviour = entry.get("behaviour") or {}
    if "before" in behaviour and "after" in behaviour:
        figures += [(label, behaviour["before"].get(key), behaviour["after"].get(key), True)
                    for label, key in (("greedy exact match", "exact_match"), ("top-1 agreement", "top1_agreement"),
                                       ("first disagreement", "first_disagreement"))]
    return [figure for figure in figures if figure[1] is not None and figure[2] is not None]


def _moved(before: Any, after: Any, higher_is_better: bool) -> Optional[str]:
    """"improved" / "worse" / None (unchanged or not finite)."""
    if not (_finite(before) and _finite(after)) or after == before:
        return None
    return "improved" if (after > before) == higher_is_better else "worse"


# The behaviour figures that can overrule an "improved" objective: what the corrected model generates
# (docs/quality.md, Behaviour). First disagreement follows from these two and decides nothing itself.
BEHAVIOUR_VERDICT = (("greedy exact match", "exact_match"), ("top-1 agreement", "top1_agreement"))

# What each status says about the correction against the plain merge, in the console and the card.
STATUS_WORDS = {"improved": "better than the plain merge", "worse": "worse than the plain merge",
                "mixed": "mixed against the plain merge", "unchanged": "no better than the plain merge",
                "non_finite": "not finite"}


def _behaviour_moves(entry: Dict[str, Any]) -> List[Tuple[str, Any, Any, Optional[str]]]:
    """(label, before, after, "improved" | "worse" | None) of the behaviour figures that were measured."""
    behaviour = entry.get("behaviour") or {}
    if "before" not in behaviour or "after" not in behaviour:
        return []
    moves = [(label, behaviour["before"].get(key), behaviour["after"].get(key)) for label, key in BEHAVIOUR_VERDICT]
    return [(label, b, a, _moved(b, a, True)) for label, b, a in moves if _finite(b) and _finite(a)]


def _overall(objective: str, label: str, before: Any, after: Any, entry: Dict[str, Any]) -> Tuple[str, str, str]:
    """(status, why, tie): the objective's direction, unless what the model generates says otherwise. An
    improved objective whose behaviour figures got worse is "mixed". Behaviour figures that did not move at
    all (no greedy decision on the held-out prompts changed) are a tie on behaviour, not evidence of no
    gain: the verdict leans on the distribution figure, the held-out KL to the expert, and ``tie`` says how
    many prompts tied and on what; only when that KL did not improve either is the domain "unchanged".
    The untrained identity kept by the no-regret comparison is "unchanged" whatever float noise its replay adds."""
    kept = entry.get("no_regret") or {}
    if kept.get("kept") == "start" and kept.get("start") == "identity" and objective != "non_finite":
        return "unchanged", "the untrained start (the identity: the plain merge) was kept", ""
    if objective == "unchanged":
        return "unchanged", f"an exact tie: {label} {_short(before)} before and after", ""
    moves = _behaviour_moves(entry)
    if objective != "improved" or not moves:
        return objective, "", ""
    worse = [f"{m} got worse ({_short(b)} -> {_short(a)})" for m, b, a, direction in moves if direction == "worse"]
    if worse:
        return "mixed", f"{label} improved but {' and '.join(worse)}", ""
    if any(direction is not None for *_, direction in moves):
        return "improved", "", ""
    tie = behaviour_tie(entry, moves)
    kl = entry.get("held_out_kl") or {}
    if _moved(kl.get("before"), kl.get("after"), False) == "improved":
        return "improved", "", (f"{tie}: a tie on behaviour, not evidence of no gain; the distribution improved "
                                f"(KL to expert {_short(kl['before'])} -> {_short(kl['after'])})")
    return "unchanged", (f"{label} improved ({_short(before)} -> {_short(after)}) but the KL to the expert did not "
                         f"({_short(kl.get('before'))} -> {_short(kl.get('after'))}) and {tie}"), ""


def behaviour_tie(entry: Dict[str, Any], moves) -> str:
    """``"no greedy decision changed on the 10 held-out prompts (greedy exact match 1 -> 1, ...)"``: what tied,
    on how many prompts, and whether the plain merge already wrote the expert's continuation on every one."""
    prompts = (entry.get("behaviour") or {}).get("prompts")
    counted = f"the {prompts} held-out prompt{'s' if prompts != 1 else ''}" if isinstance(prompts, int) \
        else "the held-out prompts"
    figures = ", ".join(f"{m} {_short(b)} -> {_short(a)}" for m, b, a, _ in moves)
    ceiling = "; the plain merge already wrote the expert's continuation on every one" \
        if all(b == 1 for _, b, _, _ in moves) else ""
    return f"no greedy decision changed on {counted} ({figures}{ceiling})"


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def domain_verdict(entry: Dict[str, Any], loss: str) -> Dict[str, Any]:
    """``{"status": "improved" | "mixed" | "unchanged" | "worse" | "non_finite", "decided_by", "before",
    "after", "measured_on", "disagreeing"}`` and, unless improved, ``"why"``: whether the correction beat
    the plain merge; ``"behaviour_tie"`` when it improved the distribution and no greedy decision changed.
    The metric that decides (``verdict_metrics``) gives the direction; where the behaviour figures were
    measured, "improved" also needs the greedy exact match and top-1 agreement to get no worse, and, when
    neither moved, the held-out KL to the expert to improve (``_overall``). ``disagreeing`` lists every other measured
    figure (``verdict_metrics``' others and ``measured_figures``) that moved against the deciding metric."""
    (label, before, after), *others = verdict_metrics(entry, loss)
    objective = _status(before, after)
    status, why, tie = _overall(objective, label, before, after, entry)
    held_out = entry.get("bias_split", "held_out") == "held_out"
    verdict = {"status": status, "decided_by": f"{'held-out' if held_out else 'training-records'} {label}",
               "metric": label, "before": before, "after": after,
               "measured_on": "held-out records" if held_out else "training records"}
    if why:
        verdict["why"] = why
    if tie:  # improved on the distribution, tied on behaviour: said, with the number of prompts
        verdict["behaviour_tie"] = tie
    figures = [(other, b, a, False) for other, b, a in others]
    figures += [figure for figure in measured_figures(entry) if figure[0] not in {label, *(o[0] for o in others)}]
    moved = [(other, b, a, _moved(b, a, higher)) for other, b, a, higher in figures]
    verdict["disagreeing"] = [{"metric": other, "before": b, "after": a, "status": direction}
                              for other, b, a, direction in moved
                              if objective in ("improved", "worse") and direction is not None and direction != objective]
    return verdict


def verdict_note(verdict: Dict[str, Any]) -> str:
    """``"decided by held-out ewl1 loss; KL to expert got worse"``, or ``"decided by held-out KL to expert;
    mixed: KL to expert improved but greedy exact match got worse (0.6 -> 0.4)"``: the verdict's basis, one phrase."""
    if not verdict:
        return ""
    note = f"decided by {verdict.get('decided_by', verdict.get('metric', '?'))}"
    if verdict.get("why"):  # why a measured objective did not make it "improved"
        note += f"; {verdict['status']}: {verdict['why']}"
    if verdict.get("behaviour_tie"):
        note += f"; {verdict['behaviour_tie']}"
    for other in verdict.get("disagreeing") or ():
        if other["metric"] not in verdict.get("why", ""):  # said already
            note += f"; {other['metric']} got {'worse' if other['status'] == 'worse' else 'better'}"
    return note


def choose_default(report: Dict[str, Any], requested: str, allow_worse: bool) -> str:
    """The domain the output loads with. A requested domain whose verdict is not "improved" becomes
    "none" (the plain merge) unless ``allow_worse`` (surgery.allow_worse_default); the choice and
    its reason are recorded in ``report["default_domain"]``."""
    entry = report.get("domains", {}).get(requested)
    verdict = (entry or {}).get("verdict") or {}
    status = verdict.get("status")
    chosen, reason = requested, None
    if entry is not None and status != "improved":
        if status == "non_finite":
            chosen, reason = "none", "its metric is not finite"
        elif allow_worse:
            reason = f"kept although {STATUS_WORDS.get(status, status)} (surgery.allow_worse_default: true)"
        else:
            why = f" ({verdict['why']})" if verdict.get("why") else ""
            chosen, reason = "none", f"{STATUS_WORDS.get(status, status)}{why}"
    report["default_domain"] = {"requested": requested, "used": chosen, **({"reason": reason} if reason else {})}
    return chosen


def finite_report(data: Any, path: str = "", found: Optional[List[str]] = None):
    """``data`` with every NaN/inf float replaced by None, and the JSON paths replaced: the report
    must stay valid JSON (``write_json`` refuses NaN) and say which values were not finite."""
    found = [] if found is None else found
    if isinstance(data, float) and not math.isfinite(data):
        found.append(path or "$")
        return None
    if isinstance(data, dict):
        return {key: finite_report(value, f"{path}.{key}" if path else str(key), found) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite_report(value, f"{path}[{i}]", found) for i, value in enumerate(data)]
    return data


def sanitized_report(report: Dict[str, Any]) -> Dict[str, Any]:
    """The report as written to darts_report.json: non-finite numbers -> null, listed under
    ``"non_finite_values"`` (absent when there were none)."""
    found: List[str] = []
    clean = finite_report({k: v for k, v in report.items() if k != "non_finite_values"}, "", found)
    if found:
        clean["non_finite_values"] = found
    return clean
