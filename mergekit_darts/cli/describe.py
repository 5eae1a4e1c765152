"""``mergekit-darts info``'s text: one ``key: value`` line per setting, the router in readable lines.

Torch-free: it formats what ``output.info.read_darts_info`` read from the files.
"""

from typing import List

from mergekit_darts.console import before_after, few_records_note, routing_accuracy

# keys printed in their own lines below, not as "key: value"
_OWN_LINES = ("domains", "router", "share", "share_7b", "parameters", "merged_parameters")


def info_lines(info: dict) -> List[str]:
    from mergekit_darts.repair.budget import describe_share

    lines = [f"{key}: {_shown(key, value, info)}" for key, value in info.items() if key not in _OWN_LINES]
    added = f"parameters: {info.get('parameters', 0):,} added"
    if info.get("share") is not None:
        added += f" ({100 * info['share']:.3f}% of the merged model's {info['merged_parameters']:,})"
    lines.append(added)
    if info.get("share_7b") is not None:
        lines.append(f"share_7b: {describe_share(info['share_7b'])}")
    for name, entry in info.get("domains", {}).items():
        lines.append(_domain_line(name, entry))
    lines += router_lines(info.get("router"))
    return lines


def _shown(key: str, value, info: dict):
    """A setting as printed: without block adapters (depth 0) their rank is stored as 0, which is no
    rank anyone set (docs/options.md gives depth_rank's default, 8, used when depth > 0)."""
    if key == "depth_rank" and not info.get("depth"):
        return "- (no block adapters: depth 0)"
    return value


def _domain_line(name: str, entry: dict) -> str:
    line = f"domain {name}: expert {entry.get('expert')}, {entry.get('parameters', 0):,} parameters"
    calibration = entry.get("calibration")
    if calibration:
        line += f", calibration {calibration.get('train')} train / {calibration.get('held_out')} held-out"
    for part in (before_after(entry.get("bias"), "held-out bias"),
                 before_after(entry.get("held_out_kl"), "held-out KL")):
        if part:
            line += f", {part}"
    if entry.get("train_seconds") is not None:
        line += f", train {entry['train_seconds']:.1f} s"
    return line


def router_lines(router) -> List[str]:
    """The router's settings, its accuracy with sample sizes (``pooled``: over all records, not a
    mean of the domains' rates), the confusion matrix and the out-of-domain fallback."""
    if not router:
        return ["router: none (a single domain, or router: false)"]
    lines = [f"router: {router.get('kind')}, threshold {router.get('threshold')}, pooling {router.get('pooling')}, "
             f"{router.get('parameters', 0):,} parameters"]
    if router.get("confusion") or router.get("accuracy"):
        split = "held-out" if router.get("split") == "held_out" else "training-set"
        lines.append(f"router {split} accuracy: {routing_accuracy(router)}")
    labels = [*router.get("domains", []), "none"]
    for name, row in (router.get("confusion") or {}).items():
        lines.append(f"router confusion {name}: " + " ".join(f"{label}={row.get(label, 0)}" for label in labels))
    ood = router.get("out_of_domain") or {}
    if ood.get("none_share") is not None:
        if ood.get("source") == "router_eval":
            what = f"{ood.get('records')} router_eval texts"
        else:
            what = "each domain's prompts with that domain left out of the router"
        lines.append(f"router fallback: {100 * ood['none_share']:.1f}% of out-of-domain prompts go to none ({what})")
    note = few_records_note(router)
    return lines + ([note] if note else [])
