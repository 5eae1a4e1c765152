"""The demo's results.md: the score table, what the README says of the rows it quotes, and which CPU
kernels trained the family (torch-free; ``run.py`` writes it)."""

import os
from typing import Dict, List

# The README's figures for the demo's `preset: best` rows (run.PRESET_ROWS), math / code / instruct:
# (six-seed mean, seed 0's scores, the recipe measured), the AVX2 kernels' family (docs/quality.md);
# tests/test_demo_run.py checks that the README still says these.
RELU_RECIPE = "measured with the ReLU final-state correction the preset had until 2026-12-06, at 500 fixed steps"
README_PRESET = {"preset_best": ("24.5 / 100 / 53.5", "29 / 100 / 55",
                                 "the preset as it ships: every block, 500 steps on minibatches of 12"),
                 "preset_best_synth": ("38.7 / 100 / 57.8", "39 / 100 / 58", RELU_RECIPE)}
# The experts' scores in the README and docs/results.md: seed 0, default sizes, torch's AVX2 kernels.
# The same seed and code train a different family with the AVX512 kernels (44 / 100 / 68 there).
REFERENCE_EXPERTS = {"math": 42.0, "code": 100.0, "instruct": 60.0}
REFERENCE_KERNELS = "AVX2"
AVX2_ENV = "ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2"


def markdown_table(result: dict, domains: List[str]) -> str:
    """results.md from run_demo's result."""
    head = "| Model | " + " | ".join(domains) + " | Average |"
    lines = [
        f"Held-out accuracy (%), greedy decoding; {', '.join(f'{d}: {n} problems' for d, n in result['test_examples'].items())}.",
        "math = exact match of `#### n`; code = hidden tests pass in a sandbox (pass@1); instruct = exact match.",
        "",
        head,
        "|" + "---|" * (len(domains) + 2),
    ]
    for key, scores in result["rows"].items():
        cells = " | ".join(f"{scores[d]:.1f}" for d in domains)
        lines.append(f"| {result['labels'][key]} | {cells} | {scores['average']:.1f} |")
    lines += ["", *preset_note(result, domains), "", *kernel_note(result, domains)]
    routing = (result.get("routing") or {}).get("test_prompts")
    if routing:
        own = ", ".join(f"{d} {100 * routing[d][d]:.1f}%" for d in domains)
        fallback = ", ".join(f"{d} {100 * routing[d]['none']:.1f}%" for d in domains)
        lines += ["", f"Routing ({result['routing'].get('label')}): test prompts routed to their own domain: {own}; "
                      f"to \"none\" (the plain merge): {fallback}."]
    gaps = result.get("kl_gap_closed") or {}
    if gaps:
        lines += [
            "",
            "Share of the held-out next-token KL gap (expert vs plain merge) each correction closes, on held-out "
            "calibration records (1 = the expert's distribution, 0 = the plain merge, < 0 = further away):",
            "",
            "| Surgery | " + " | ".join(domains) + " |",
            "|" + "---|" * (len(domains) + 1),
        ]
        for key, per_domain in gaps.items():
            cells = " | ".join("–" if per_domain.get(d) is None else f"{per_domain[d]:.2f}" for d in domains)
            lines.append(f"| {result['labels'][key]} | {cells} |")
    return "\n".join(lines) + "\n"


def _scores(scores: Dict[str, float], domains: List[str]) -> str:
    return " / ".join(f"{scores[d]:.0f}" for d in domains)


def preset_note(result: dict, domains: List[str]) -> List[str]:
    """What the README says of the ``preset: best`` rows, beside what this run scored (or how to run it)."""
    claims = result.get("readme_preset") or {}
    if not claims:
        return []
    parts = []
    for key, (label, mean, seed_0, *recipe) in claims.items():
        scored = (f"this run (seed {result['seed']}): {_scores(result['rows'][key], domains)}" if key in result["rows"]
                  else "not run here (`mergekit-darts demo --all-rows` runs it)")
        parts.append(f"{label}: {mean} (seed 0: {seed_0}{''.join('; ' + r for r in recipe)}); {scored}")
    return ["The README's figures for `preset: best` on this demo (" + " / ".join(domains) + "; six-seed means, "
            f"the {REFERENCE_KERNELS} kernels' family): " + "; ".join(parts) + ". "
            f"Its YAML: {os.path.basename(result['preset_config'])}; its output: "
            f"{os.path.basename(result['preset_output_dir'])}/."]


def kernel_note(result: dict, domains: List[str]) -> List[str]:
    """Which CPU kernels trained this family, and whether it is the family the README's numbers come
    from (the same seed and code train another one with other vector kernels; docs/results.md#the-demo)."""
    capability = result.get("cpu_capability") or "unknown"
    reference = " / ".join(f"{REFERENCE_EXPERTS[d]:.0f}" for d in domains)
    lines = [f"This family was trained with torch's {capability} CPU kernels. The README's and docs/results.md's "
             f"numbers come from seed 0 at full size with the {REFERENCE_KERNELS} kernels (experts {reference})."]
    if not result.get("reference_run"):
        return lines + ["This run has another seed or size, so its numbers are not expected to equal those."]
    experts = {d: result["rows"][f"expert_{d}"][d] for d in domains if f"expert_{d}" in result["rows"]}
    if experts == {d: REFERENCE_EXPERTS[d] for d in domains}:
        return lines + ["The experts score the same here: this is that family, and every row compares with "
                        "the README's."]
    return lines + [f"The experts score {_scores(experts, domains)} here: another family (an AVX512 CPU trains one "
                    "whose experts score 44 / 100 / 68), so every row differs from the README's. To train the "
                    f"README's family on this CPU, start the demo as: {AVX2_ENV} mergekit-darts demo"]
