"""End to end: wall time of ``mergekit-yaml`` with a ``surgery:`` block, split into its phases.

Two measurements on one small model family (the built-in demo family, ``--family demo``, or the
instant random family of ``mergekit_darts.tiny``, ``--family tiny``):

1. Phases, in one process. We call what ``mergekit-yaml`` calls —
   ``pipeline.merge_and_repair(..., run_merge)``, what the start-up hook's wrapper runs in place of
   mergekit's ``run_merge`` — with timing wrappers around mergekit's own ``run_merge`` (merge),
   ``capture.capture_domains`` (capture: loading each model and computing hidden states and
   entropies), ``train.train_surgery`` (train: summed over the domains) and
   ``export.export_surgery`` (export). "other" is the rest of the surgery step: pre-merge
   validation, tokenizer and calibration loading, held-out bias evaluation, the plot. Interpreter
   start-up and imports are not in these figures (they are in measurement 2).
2. The real command. ``mergekit-yaml cfg.yml out`` in a subprocess with the surgery block, and the
   same YAML without it (a plain merge), each ``--repeats`` times (default 1), interleaved; the figure
   is wall(with surgery) / wall(plain merge), median of the paired rounds.

Threads: by default torch picks its thread count (what a user gets). On a small, oversubscribed
machine that is itself a large effect for tiny tensors (see README); ``--threads 1`` pins it.

Every run uses a fresh, empty capture cache, so capture is really computed.

    python benchmarks/speed_memory/bench_end_to_end.py --threads 1        # demo family (quick size), ~3 min on 2 cores
    python benchmarks/speed_memory/bench_end_to_end.py --family tiny      # no family training at all
    python benchmarks/speed_memory/bench_end_to_end.py --family-dir /tmp/demo_family --spec full --steps 500
"""

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import add_output_options, log, machine_info, median, paired_ratio, print_table, write_json  # noqa: E402

DEMO_DOMAINS = ("math", "code", "instruct")
PHASES = ("merge", "capture", "train", "export")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", choices=["demo", "tiny"], default="demo")
    p.add_argument("--spec", choices=["quick", "full"], default="quick", help="demo FamilySpec size")
    p.add_argument("--family-dir", default=None, help="build/reuse the family here (default: a temp dir)")
    p.add_argument("--samples", type=int, default=50, help="calibration texts per domain (paper: 50)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-positions", type=int, default=128)
    p.add_argument("--steps", type=int, default=500, help="surgery steps per domain (paper: 500)")
    p.add_argument("--loss", default="ewl1")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=1, help="rounds of the mergekit-yaml comparison")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads, here and (OMP_NUM_THREADS) in the mergekit-yaml subprocesses; "
                        "default: torch's own choice, i.e. what a user gets")
    p.add_argument("--skip-cli", action="store_true", help="only the in-process phase split")
    add_output_options(p)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------- the family

def demo_family(root: str, args):
    """(paths, {domain: calibration prompts}) of the demo family, trained (or reused) under ``root``."""
    from mergekit_darts.demo.family import FamilySpec, build_family
    from mergekit_darts.demo.tasks import make_splits, vocabulary

    spec = FamilySpec.quick() if args.spec == "quick" else FamilySpec()
    splits = {d: make_splits(d, seed=0, train=spec.train_examples, calib=args.samples) for d in DEMO_DOMAINS}
    words = vocabulary(list(splits.values()))
    paths = build_family(root, splits, words, seed=0, spec=spec, progress=False, log=lambda m: log(m))
    texts = {d: [ex["prompt"] for ex in splits[d]["calib"]] for d in DEMO_DOMAINS}
    return paths, texts


def tiny_family(root: str, args):
    from mergekit_darts.tiny import DEFAULT_WORDS, make_family

    import random

    paths = make_family(root, domains=list(DEMO_DOMAINS), seed=0, max_position_embeddings=max(256, args.max_positions))
    rng = random.Random(0)
    texts = {d: [" ".join(rng.choice(DEFAULT_WORDS) for _ in range(rng.randint(8, 40))) for _ in range(args.samples)]
             for d in DEMO_DOMAINS}
    return paths, texts


def config_yaml(paths: dict, texts: dict, cache_dir: str, args, surgery: bool = True) -> str:
    config = {
        "merge_method": "task_arithmetic",
        "base_model": paths["base"],
        "models": [{"model": paths[d], "parameters": {"weight": 0.5}} for d in DEMO_DOMAINS],
        "dtype": "float32",
    }
    if surgery:
        config["surgery"] = {
            "method": "darts", "loss": args.loss, "rank": args.rank, "max_positions": args.max_positions,
            "steps": args.steps, "lr": 1.0e-3, "seed": 0, "device": args.device, "dtype": "float32",
            "cache_dir": cache_dir, "default_domain": DEMO_DOMAINS[0],
            "domains": {d: {"model": paths[d], "calibration": {"texts": texts[d], "samples": len(texts[d])}}
                        for d in DEMO_DOMAINS},
        }
    return yaml.safe_dump(config, sort_keys=False)


# ------------------------------------------------------------------------ 1. phases, in one process

class PhaseTimer:
    """Accumulates wall seconds per phase; ``wrap`` returns a timing wrapper of a function."""

    def __init__(self):
        self.seconds = {phase: 0.0 for phase in PHASES}
        self.calls = {phase: 0 for phase in PHASES}

    def wrap(self, phase, fn):
        @functools.wraps(fn)
        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[phase] += time.perf_counter() - start
                self.calls[phase] += 1
        return timed


def phases_in_process(config_source: str, out_dir: str) -> dict:
    from mergekit.config import MergeConfiguration
    from mergekit.options import MergeOptions

    import mergekit_darts.output.export as export
    import mergekit_darts.repair.capture.domains as capture
    import mergekit_darts.repair.train.selection as train
    from mergekit_darts import hook
    from mergekit_darts.pipeline import merge_and_repair, parse_config_source

    timer = PhaseTimer()
    saved = (capture.capture_domains, train.train_surgery, export.export_surgery)
    # the pipeline imports capture_domains / export_surgery at call time, and fit calls the train_surgery
    # of its module (train/selection.py): patch those modules' names
    capture.capture_domains = timer.wrap("capture", capture.capture_domains)
    train.train_surgery = timer.wrap("train", train.train_surgery)
    export.export_surgery = timer.wrap("export", export.export_surgery)
    try:
        merge_part, _ = parse_config_source(config_source)
        merge_config = MergeConfiguration.model_validate(merge_part)
        options = MergeOptions(quiet=True, copy_tokenizer=True, lazy_unpickle=False)
        run_merge = timer.wrap("merge", hook.original_run_merge())
        start = time.perf_counter()
        report = merge_and_repair(config_source, out_dir, run_merge, options=options, merge_config=merge_config)
        total = time.perf_counter() - start
    finally:
        capture.capture_domains, train.train_surgery, export.export_surgery = saved
    with open(os.path.join(out_dir, "config.json")) as handle:
        architecture = json.load(handle)["architectures"][0]
    other = total - sum(timer.seconds.values())
    return {
        "total_s": total, "seconds": {**timer.seconds, "other": other}, "calls": timer.calls,
        "share": {k: v / total for k, v in {**timer.seconds, "other": other}.items()},
        "architecture": architecture,
        "final_loss": {d: e.get("final_loss") for d, e in (report or {}).get("domains", {}).items()},
    }


# --------------------------------------------------------------------- 2. the real mergekit-yaml

def mergekit_yaml_wall(config_source: str, workdir: str, tag: str, threads=None) -> float:
    cfg = os.path.join(workdir, f"{tag}.yml")
    out = os.path.join(workdir, f"out-{tag}")
    with open(cfg, "w") as handle:
        handle.write(config_source)
    shutil.rmtree(out, ignore_errors=True)
    exe = os.path.join(os.path.dirname(sys.executable), "mergekit-yaml")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    start = time.perf_counter()
    proc = subprocess.run([exe, cfg, out], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"mergekit-yaml ({tag}) failed:\n{proc.stderr[-4000:]}")
    shutil.rmtree(out, ignore_errors=True)
    return wall


def cli_comparison(paths, texts, workdir: str, args) -> dict:
    times = {"surgery": [], "plain": []}
    for round_index in range(args.repeats):
        order = ("surgery", "plain") if round_index % 2 == 0 else ("plain", "surgery")
        for tag in order:
            cache = tempfile.mkdtemp(dir=workdir, prefix="cache-")  # fresh: capture really runs
            source = config_yaml(paths, texts, cache, args, surgery=(tag == "surgery"))
            log(f"mergekit-yaml round {round_index + 1}/{args.repeats}: {tag}")
            times[tag].append(mergekit_yaml_wall(source, workdir, tag, args.threads))
            shutil.rmtree(cache, ignore_errors=True)
    return {
        "seconds": times,
        "median_s": {k: median(v) for k, v in times.items()},
        "ratio_surgery_over_plain": paired_ratio(times["surgery"], times["plain"]),
    }


def main(argv=None):
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    workdir = tempfile.mkdtemp(prefix="bench_e2e-")
    try:
        family_dir = args.family_dir or os.path.join(workdir, "family")
        log(f"family: {args.family} ({args.spec if args.family == 'demo' else 'random'}) in {family_dir}")
        start = time.perf_counter()
        paths, texts = (demo_family if args.family == "demo" else tiny_family)(family_dir, args)
        family_s = time.perf_counter() - start
        log(f"family ready after {family_s:.1f}s (not part of any figure)")

        cache = tempfile.mkdtemp(dir=workdir, prefix="cache-")
        log("phases, in process")
        phases = phases_in_process(config_yaml(paths, texts, cache, args), os.path.join(workdir, "out"))
        cli = None if args.skip_cli else cli_comparison(paths, texts, workdir, args)
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(paths["base"])
        model_desc = f"hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    rows = [[p, phases["seconds"][p], f"{100 * phases['share'][p]:.1f}%"] for p in (*PHASES, "other")]
    rows.append(["total (in process)", phases["total_s"], "100%"])
    print_table(
        f"mergekit-yaml + surgery, phases (one process, wall): {args.family} family ({model_desc}), "
        f"3 experts, task_arithmetic, {args.samples} calibration texts/domain, rank {args.rank}, "
        f"max_positions {args.max_positions}, {args.steps} steps, loss {args.loss}, {args.device}, "
        f"{threads} torch thread(s)",
        ["phase", "seconds", "share"], rows,
    )
    if cli:
        r = cli["ratio_surgery_over_plain"]
        print_table(
            f"the real mergekit-yaml command (subprocess wall, incl. start-up; {args.repeats} interleaved rounds)",
            ["with surgery (s)", "plain merge (s)", "surgery/plain (median)", "min..max"],
            [[cli["median_s"]["surgery"], cli["median_s"]["plain"], r["median"], f"{r['min']:.2f}..{r['max']:.2f}"]],
        )
    write_json("bench_end_to_end", {
        "benchmark": "end_to_end", "settings": vars(args), "machine": machine_info(), "model": model_desc, "torch_threads": threads,
        "family_build_s": family_s, "phases": phases, "cli": cli,
    }, args.out, overwrite=args.overwrite)


if __name__ == "__main__":
    main()
