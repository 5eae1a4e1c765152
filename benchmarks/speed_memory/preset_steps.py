"""How many steps ``preset: best`` trains when early stopping chooses them on the validation split, and
what that does to the demo's quality (issue 45 ask 7; docs/quality.md, docs/scale.md).

    python benchmarks/speed_memory/preset_steps.py DEMO_DIR --seeds 0 --tag NAME [--overrides '{"patience": 20}'] [--score]

DEMO_DIR is a demo work directory as ``bench_quality.py --prepare`` makes it. Each run takes the demo's
YAML, removes the keys it writes out (method, loss, rank, steps, lr) so the preset decides them, adds
``preset: best`` and ``--overrides``, captures (cached in DEMO_DIR), trains every domain with the
pipeline's ``train_domain`` and records per domain: the step early stopping chose, the steps the
stopped run took, the refit's steps, every validation check ([step, loss]: the curve), the held-out
gap closed, the behaviour figures and the training seconds; with ``--score`` also the task scores of
the exported model. Appends to benchmarks/results/preset_steps.json under --tag (after every seed).

``--lr-decay linear`` is an experiment, not a setting of the plugin: every Adam of the process takes
its lr times (1 - t / steps) at its step t (the cap ``steps``), so the stopped run and its refit follow
the same schedule. It is recorded under the run's ``experiment``.

Seeds run side by side (two processes, one torch thread each) need a DEMO_DIR copy each: every run exports
into DEMO_DIR/merged, and an export clears any other export's staging folder there as a leftover.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import RESULTS_DIR, machine_info  # noqa: E402

WRITTEN_BY_THE_DEMO = ("method", "loss", "rank", "steps", "lr")


def configure(demo_dir: str, overrides: dict, seed: int):
    import yaml

    from mergekit_darts.pipeline import parse_config_source

    with open(os.path.join(demo_dir, "demo.yml")) as handle:
        data = yaml.safe_load(handle)
    block = {k: v for k, v in data["surgery"].items() if k not in WRITTEN_BY_THE_DEMO}
    data["surgery"] = {"preset": "best", **block, **overrides, "seed": seed}
    _, surgery = parse_config_source(yaml.safe_dump(data, sort_keys=False))
    return surgery


# every EarlyStopping's validation curve, in creation order (record_curves patches selection once)
CURVES: list = []


def record_curves() -> list:
    """Make every ``EarlyStopping`` of this process append its validation curve to ``CURVES`` (patched
    once per process); returns ``CURVES``."""
    from mergekit_darts.repair.train import selection

    if not getattr(selection.EarlyStopping, "recorded", False):
        class Recorded(selection.EarlyStopping):
            recorded = True

            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                CURVES.append(self.curve)

        selection.EarlyStopping = Recorded
    return CURVES


def decay_lr_linearly(horizon: int) -> None:
    """Every ``torch.optim.Adam`` made from here on in this process decays its lr linearly to zero at
    step ``horizon`` (its own step count: each training run and refit starts at the full lr)."""
    import torch

    class LinearDecayAdam(torch.optim.Adam):
        def step(self, closure=None):
            for group in self.param_groups:
                group.setdefault("initial_lr", group["lr"])
                done = group.setdefault("steps_done", 0)
                group["lr"] = group["initial_lr"] * max(0.0, 1.0 - done / horizon)
                group["steps_done"] = done + 1
            return super().step(closure)

    torch.optim.Adam = LinearDecayAdam


def run_seed(demo_dir: str, overrides: dict, seed: int, score: bool) -> dict:
    import torch

    from mergekit_darts.pipeline import capture_step
    from mergekit_darts.presets import preset_settings
    from mergekit_darts.repair.train.domain import train_domain
    from mergekit_darts.settings import RunSettings

    surgery = configure(demo_dir, overrides, seed)
    settings = RunSettings.resolve(surgery, None, progress=False)
    out = os.path.join(demo_dir, "merged")
    from mergekit_darts.pipeline import resolve_from_model

    surgery = resolve_from_model(surgery, out)
    start = time.perf_counter()
    captured = capture_step(out, surgery, settings)
    result = {"capture_s": round(time.perf_counter() - start, 1), "preset_settings": preset_settings(surgery),
              "domains": {}}
    report = {"surgery": {**surgery.model_dump(exclude={"domains"}), "seed": seed}, "domains": {}}
    if captured.tail is not None:
        report["surgery"]["layers"] = captured.tail.first + len(captured.tail.layers)
    modules = {}
    for domain, data in captured.domains.items():
        curves = record_curves()
        first = len(curves)  # this domain's stoppers are the ones created from here on
        torch.manual_seed(seed)
        trained = train_domain(domain, data, captured.merged_head, surgery, settings, tail=captured.tail,
                               merged_dir=out)
        modules[domain], entry = trained.module, trained.entry
        report["domains"][domain] = entry
        selection = entry["selection"]
        candidates = selection.get("candidates") or [{}]
        result["domains"][domain] = {
            "chosen_steps": selection.get("steps"), "steps_run": candidates[0].get("steps_run"),
            "refit_records": selection.get("refit_records"), "validation_curve": curves[first] if len(curves) > first else None,
            "gap_closed": entry["held_out_kl"]["gap_closed"], "kl_before": entry["held_out_kl"]["before"],
            "kl_after": entry["held_out_kl"]["after"], "behaviour": entry["behaviour"],
            "train_seconds": entry["train_seconds"], "records": entry["calibration"],
            "baseline_gap_closed": (entry.get("baseline") or {}).get("held_out_kl", {}).get("gap_closed")}
        print(f"s{seed} {domain:8s} chose {selection.get('steps')} of {candidates[0].get('steps_run')} run, "
              f"gap {entry['held_out_kl']['gap_closed']:.3f} ({entry['train_seconds']:.0f} s)", flush=True)
    if score:
        from bench_quality import export_and_score, load_test

        result["scores"], result["score_s"] = export_and_score(out, captured, surgery, settings, modules, report,
                                                               load_test(demo_dir))
        print(f"s{seed} scores {result['scores']} ({result['score_s']} s)", flush=True)
    return result


def save(tag: str, run: dict) -> str:
    """Store ``run`` under ``tag``; two processes (seeds run side by side) take turns through a lock."""
    import fcntl

    path = os.path.join(RESULTS_DIR, "preset_steps.json")
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stored = json.load(open(path)) if os.path.exists(path) else {}
        stored.setdefault("runs", {})[tag] = run
        with open(path + ".tmp", "w") as handle:
            json.dump(stored, handle, indent=1)
        os.replace(path + ".tmp", path)
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("demo_dir")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--overrides", default="{}", help="JSON: surgery keys on top of preset: best")
    parser.add_argument("--score", action="store_true", help="export and score on the demo's test sets")
    parser.add_argument("--tag", required=True)
    parser.add_argument("--lr-decay", choices=["linear"], help="experiment: Adam's lr decays to 0 at the step cap")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # the demo's setting
    run = {"command": " ".join(sys.argv), "machine": machine_info(), "overrides": json.loads(args.overrides),
           "seeds": {}}
    if args.lr_decay:
        cap = configure(args.demo_dir, run["overrides"], args.seeds[0]).steps
        decay_lr_linearly(cap)
        run["experiment"] = {"lr_decay": args.lr_decay, "horizon": cap}
    for seed in args.seeds:
        run["seeds"][str(seed)] = run_seed(args.demo_dir, run["overrides"], seed, args.score)
        path = save(args.tag, run)
    print(f"wrote {path} [{args.tag}]")


if __name__ == "__main__":
    main()
