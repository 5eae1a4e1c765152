"""Multi-seed comparison of surgery variants (Table 4 of the DARTS paper, arXiv 2608.28547).

``run_compare`` trains standard surgery + L1 and DARTS + EWL1 once per calibration seed on the same
merged directory (the hidden-state capture is cached, so each rerun only trains), scores every run,
and ``summarize_groups`` reports per-group mean/std, Shapiro-Wilk normality per group and a
two-sided Mann-Whitney U test between groups (scipy). Scorers decide what "score" means:

- ``heldout_scorer`` (default, no generation): held-out bias after surgery from the run's report
  (mean L1 and entropy-weighted L1 to the expert; plus held-out KL when the report has it).
  **Lower is better** for these.
- ``task_scorer``: lm-eval task scores per domain (``evaluation.evaluate``); higher is better.
- ``demo_scorer``: accuracy on the offline demo family's test sets (``mergekit_darts.demo``).
"""

import itertools
import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

GROUPS: Dict[str, Dict[str, str]] = {
    "standard+l1": {"method": "standard", "loss": "l1"},
    "darts+ewl1": {"method": "darts", "loss": "ewl1"},
}
Scorer = Callable[[str, Dict[str, Any]], Dict[str, float]]


def _finite(value: float) -> Optional[float]:
    """float, or None where scipy gives NaN/inf (JSON has no NaN)."""
    value = float(value)
    return value if math.isfinite(value) else None


def summarize_groups(scores: Mapping[str, Sequence[float]]) -> Dict[str, Any]:
    """Per group: n, scores, mean, sample std (ddof=1), Shapiro-Wilk W/p (n >= 3, else None);
    per pair of groups (in the given order): two-sided Mann-Whitney U (of the first group) and p."""
    import warnings

    import numpy as np
    from scipy import stats

    groups: Dict[str, Any] = {}
    for name, values in scores.items():
        x = np.asarray(list(values), dtype=float)
        entry: Dict[str, Any] = {
            "n": int(x.size), "scores": x.tolist(),
            "mean": _finite(x.mean()) if x.size else None,
            "std": _finite(x.std(ddof=1)) if x.size >= 2 else None,
            "shapiro": None,
        }
        if x.size >= 3:
            with warnings.catch_warnings():  # constant samples warn; W/p still come back
                warnings.simplefilter("ignore")
                result = stats.shapiro(x)
            entry["shapiro"] = {"W": _finite(result.statistic), "p": _finite(result.pvalue)}
        groups[name] = entry
    tests: Dict[str, Any] = {}
    for a, b in itertools.combinations(scores, 2):
        x, y = list(scores[a]), list(scores[b])
        if not x or not y:
            tests[f"{a} vs {b}"] = None
            continue
        result = stats.mannwhitneyu(x, y, alternative="two-sided")
        tests[f"{a} vs {b}"] = {"U": _finite(result.statistic), "p": _finite(result.pvalue),
                                "alternative": "two-sided"}
    return {"groups": groups, "mann_whitney": tests}


# ----------------------------------------------------------------------------------------------
# Scorers: (out_dir, surgery report) -> {metric name: value}

def heldout_scorer(out_dir: str, report: Dict[str, Any]) -> Dict[str, float]:
    scores = {}
    for domain, entry in report.get("domains", {}).items():
        bias = entry.get("bias") or {}
        for key, name in (("mean_after", "heldout_l1"), ("mean_after_weighted", "heldout_ewl1")):
            if bias.get(key) is not None:
                scores[f"{domain}/{name}"] = float(bias[key])
        if (entry.get("held_out_kl") or {}).get("after") is not None:
            scores[f"{domain}/heldout_kl"] = float(entry["held_out_kl"]["after"])
    return scores


def task_scorer(tasks: Sequence[str], **evaluate_kwargs) -> Scorer:
    """Every lm-eval metric of ``tasks``, per domain of the report, with that domain active."""
    from mergekit_darts.evaluation.harness import evaluate

    def score(out_dir: str, report: Dict[str, Any]) -> Dict[str, float]:
        scores = {}
        for domain in report.get("domains", {}):
            # the directory's code was written by this run's export (the packaged remote_code files)
            result = evaluate(out_dir, domain, tasks, trust_remote_code=True, **evaluate_kwargs)
            for task, metrics in result["tasks"].items():
                scores.update({f"{domain}/{task}/{metric}": value for metric, value in metrics.items()})
        return scores
    return score


def demo_scorer(seed: int = 0) -> Scorer:
    """Accuracy (%) on the demo family's test split of each (demo) domain, that domain active."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mergekit_darts.demo import tasks as demo_tasks
    from mergekit_darts.demo.evaluate import score_model

    def score(out_dir: str, report: Dict[str, Any]) -> Dict[str, float]:
        domains = list(report.get("domains", {}))
        unknown = [d for d in domains if d not in demo_tasks.DOMAINS]
        if unknown:
            raise ValueError(f"--demo: domains {unknown} are not demo domains {list(demo_tasks.DOMAINS)}")
        model = AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=True).eval()
        tokenizer = AutoTokenizer.from_pretrained(out_dir)
        scores = {}
        for domain in domains:
            model.set_darts_domain(domain)
            test = {domain: demo_tasks.make_splits(domain, seed=seed)["test"]}
            scores[f"{domain}/demo_accuracy"] = score_model(model, tokenizer, test)[domain]
        return scores
    return score


# ----------------------------------------------------------------------------------------------

def run_compare(
    config_source: str, out_path: str, seeds: int = 6, first_seed: int = 0, scorer: Optional[Scorer] = None,
    groups: Optional[Mapping[str, Mapping[str, Any]]] = None, restore: bool = True, options=None,
    log: Callable[[str], None] = print,
) -> Dict[str, Any]:
    """Train every group once per seed on the merged dir ``out_path``, score, and summarise.

    The surgery in ``out_path`` is replaced by each run in turn; with ``restore`` the config's own
    surgery is trained again at the end so the directory is left as the config describes it.
    """
    from mergekit_darts.pipeline import run_surgery

    if seeds < 1:
        raise ValueError(f"seeds: need at least 1, got {seeds}")
    scorer = scorer or heldout_scorer
    groups = dict(groups or GROUPS)
    runs: List[Dict[str, Any]] = []
    for seed in range(first_seed, first_seed + seeds):
        for group, overrides in groups.items():
            log(f"[compare] seed {seed}: {group}")
            report = run_surgery(config_source, out_path, overrides={**overrides, "seed": seed}, options=options)
            runs.append({"group": group, "seed": seed, "scores": scorer(out_path, report)})
    metrics = sorted({m for run in runs for m in run["scores"]})
    summary = {
        metric: {**summarize_groups({g: [r["scores"][metric] for r in runs if r["group"] == g and metric in r["scores"]]
                                     for g in groups}),
                 "better": "lower" if lower_is_better(metric) else "higher"}
        for metric in metrics
    }
    if restore:
        log("[compare] restoring the config's own surgery")
        run_surgery(config_source, out_path, options=options)
    return {"groups": {g: dict(o) for g, o in groups.items()},
            "seeds": list(range(first_seed, first_seed + seeds)), "runs": runs, "stats": summary}


def _num(value: Optional[float], digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def lower_is_better(metric: str) -> bool:
    """Held-out bias / KL (``heldout_scorer``) are distances to the expert; every other score
    (task metrics, demo accuracy) is a score to maximise."""
    return metric.rpartition("/")[2].startswith("heldout_")


def smallest_p(n_a: int, n_b: int) -> float:
    """The smallest two-sided p an exact Mann-Whitney U test can give for groups of n_a and n_b
    (complete separation, no ties): 2 / C(n_a + n_b, n_a), capped at 1."""
    return min(1.0, 2.0 / math.comb(n_a + n_b, n_a)) if n_a and n_b else 1.0


def _better(summary: Dict[str, Any], pair: str, lower: bool) -> str:
    a, b = pair.split(" vs ")
    mean_a, mean_b = summary["groups"][a]["mean"], summary["groups"][b]["mean"]
    if mean_a is None or mean_b is None or mean_a == mean_b:
        return "equal means"
    return f"{a if (mean_a < mean_b) == lower else b} better on mean"


def compare_table(result: Dict[str, Any]) -> str:
    """Per metric (with its direction): each group's per-seed scores, mean ± std, Shapiro W/p;
    then Mann-Whitney U/p and which group is better; notes where n is too small for a test."""
    lines = []
    notes = set()
    for metric, summary in result["stats"].items():
        lower = lower_is_better(metric)
        lines.append(f"{metric} ({'lower' if lower else 'higher'} is better)")
        for name, group in summary["groups"].items():
            shapiro = group["shapiro"]
            normality = (f"Shapiro W={_num(shapiro['W'])} p={_num(shapiro['p'])}" if shapiro
                         else f"Shapiro: n={group['n']}, needs 3")
            per_seed = " ".join(_num(v) for v in group["scores"])
            lines.append(f"  {name:<14} mean {_num(group['mean'])} ± {_num(group['std'])}  {normality}  [{per_seed}]")
            if not shapiro:
                notes.add("Shapiro-Wilk needs at least 3 scores per group, so normality is not tested")
        for pair, test in summary["mann_whitney"].items():
            if not test:
                continue
            a, b = pair.split(" vs ")
            n_a, n_b = summary["groups"][a]["n"], summary["groups"][b]["n"]
            lines.append(f"  Mann-Whitney {pair}: U={_num(test['U'])} p={_num(test['p'])} (two-sided; "
                         f"{_better(summary, pair, lower)})")
            floor = smallest_p(n_a, n_b)
            if floor >= 0.05:
                notes.add(f"with n={n_a} and n={n_b} seeds the smallest two-sided Mann-Whitney p possible is "
                          f"{floor:.2g}, so no difference can reach p < 0.05; use --seeds 4 or more")
    if notes:
        lines += ["", *(f"note: {note}" for note in sorted(notes))]
    return "\n".join(lines)
