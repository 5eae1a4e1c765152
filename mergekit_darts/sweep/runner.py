"""Running a sweep on Ray: one task per distinct merge, one task per cell (surgery + scoring).

Each cell task takes its merge task's result as an argument, so Ray starts it only once that merge
exists; a merge is built once however many cells share it, into ``merges/<merge hash>/``, and each
cell repairs its own hard-linked view of it in ``cells/<cell hash>/model`` (the export never rewrites
the merged weight bytes, it only renames files, so the links are safe and cost no disk).

The driver appends each finished cell to results.jsonl the moment Ray returns it; a cell that
raises is recorded with its error and the others go on. The driver never loads a model (it imports
mergekit only to validate the configs), so it can be a CPU head node.
"""

import logging
import os
import shutil
import socket
import time
import traceback
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional

from mergekit_darts.errors import DartsError
from mergekit_darts.extras import needs
from mergekit_darts.sweep.config import SweepSpec
from mergekit_darts.sweep.grid import Cell, expand, group_by_merge, validate
from mergekit_darts.sweep import results as results_io

LOG = logging.getLogger(__name__)
MERGE_MARKER = ".sweep_merge.json"  # written last: a merge dir without it is incomplete


def import_ray():
    try:
        import ray
    except ImportError:
        raise DartsError(needs("mergekit-darts sweep (Ray, not installed)", "sweep")) from None
    return ray


def package_root() -> str:
    """The folder holding this copy of mergekit_darts: Ray workers import the package from it."""
    import mergekit_darts

    return os.path.dirname(os.path.dirname(os.path.abspath(mergekit_darts.__file__)))


def worker_runtime_env() -> Dict[str, Any]:
    """Local workers get this package first on PYTHONPATH (a source checkout works without installing)."""
    path = os.pathsep.join(p for p in (package_root(), os.environ.get("PYTHONPATH", "")) if p)
    return {"env_vars": {"PYTHONPATH": path}}


# -------------------------------------------------------------------------------- worker side

def _enter(workdir: str, num_cpus: float) -> None:
    """Relative paths of the YAML mean the driver's working directory, as they do for mergekit-yaml."""
    if os.path.isdir(workdir):
        os.chdir(workdir)
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(max(1, int(num_cpus)))
    hf_logging.disable_progress_bar()  # one bar per model load from every worker drowns the sweep's own


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def build_merge(merge_config: Dict[str, Any], merge_dir: str, workdir: str, num_cpus: float) -> Dict[str, Any]:
    """Ray task: mergekit's own run_merge into ``merge_dir`` (staged, then renamed). Never raises."""
    started = time.time()
    if os.path.isfile(os.path.join(merge_dir, MERGE_MARKER)):
        return {"path": merge_dir, "error": None, "seconds": 0.0, "reused": True}
    try:
        _enter(workdir, num_cpus)
        import yaml
        from mergekit.config import MergeConfiguration
        from mergekit.options import MergeOptions

        from mergekit_darts.hook import original_run_merge
        from mergekit_darts.output.layout import write_json

        import torch

        config = MergeConfiguration.model_validate(merge_config)
        staging = merge_dir + ".partial"
        shutil.rmtree(staging, ignore_errors=True)
        options = MergeOptions(quiet=True, cuda=torch.cuda.is_available())
        original_run_merge()(config, staging, options, yaml.safe_dump(merge_config, sort_keys=False))
        write_json(os.path.join(staging, MERGE_MARKER), {"config": merge_config})
        shutil.rmtree(merge_dir, ignore_errors=True)
        os.replace(staging, merge_dir)
        return {"path": merge_dir, "error": None, "seconds": time.time() - started, "reused": False}
    except Exception as error:  # recorded in every cell of this merge; the sweep goes on
        return {"path": None, "error": f"merge failed: {_error_text(error)}",
                "traceback": traceback.format_exc(), "seconds": time.time() - started}


def link_tree(source: str, target: str) -> None:
    """``target`` = a copy of ``source`` whose .safetensors files are hard links (copies where the
    file system cannot link)."""
    def link_or_copy(src, dst):
        if src.endswith(".safetensors"):
            try:
                os.link(src, dst)
                return dst
            except OSError:
                pass
        return shutil.copy2(src, dst)

    shutil.copytree(source, target, copy_function=link_or_copy,
                    ignore=shutil.ignore_patterns(MERGE_MARKER))


def cell_scores(model_dir: str, report: Dict[str, Any], scoring: Dict[str, Any], seed: int) -> Dict[str, float]:
    """Held-out metrics and final training loss per domain from the report, their means over
    domains (``mean/<metric>``), and the optional demo / lm-eval task scores."""
    from mergekit_darts.evaluation.compare import demo_scorer, heldout_scorer, task_scorer

    scores = dict(heldout_scorer(model_dir, report))
    for domain, entry in report.get("domains", {}).items():
        if entry.get("final_loss") is not None:
            scores[f"{domain}/final_loss"] = float(entry["final_loss"])
        if (entry.get("held_out_kl") or {}).get("before") is not None:  # the plain merge, for reference
            scores[f"{domain}/heldout_kl_before"] = float(entry["held_out_kl"]["before"])
    if scoring.get("demo"):
        scores.update(demo_scorer(seed=0)(model_dir, report))
    if scoring.get("tasks"):
        scores.update(task_scorer(scoring["tasks"], **scoring.get("task_options", {}))(model_dir, report))
    by_metric: Dict[str, List[float]] = {}
    for key, value in scores.items():
        domain, _, metric = key.partition("/")
        if metric and value is not None:
            by_metric.setdefault(metric, []).append(float(value))
    scores.update({f"mean/{metric}": sum(v) / len(v) for metric, v in by_metric.items()})
    return scores


def run_cell(merge_result: Dict[str, Any], cell: Dict[str, Any], merge_config: Dict[str, Any],
             surgery: Dict[str, Any], cell_dir: str, workdir: str, num_cpus: float) -> Dict[str, Any]:
    """Ray task: surgery on a linked copy of the merge, then scoring. Never raises: a failure is a
    record with ``status: failed``, the stage it failed in and the error."""
    import mergekit_darts

    record = {**cell, "status": "failed", "stage": "merge", "error": None, "scores": {},
              "seconds": {"merge": merge_result.get("seconds")}, "output": None,
              "worker": {"host": socket.gethostname(), "pid": os.getpid(), "package": mergekit_darts.__file__}}
    if merge_result.get("error"):
        record.update(error=merge_result["error"], traceback=merge_result.get("traceback"))
        return record
    try:
        _enter(workdir, num_cpus)
        import yaml

        from mergekit_darts.pipeline import run_surgery

        record["stage"] = "surgery"
        model_dir = os.path.join(cell_dir, "model")
        shutil.rmtree(cell_dir, ignore_errors=True)
        os.makedirs(cell_dir)
        link_tree(merge_result["path"], model_dir)
        record["output"] = model_dir
        started = time.time()
        source = yaml.safe_dump({**merge_config, "surgery": surgery}, sort_keys=False)
        options = SimpleNamespace(device=None, cuda=False, random_seed=None, trust_remote_code=False, quiet=True)
        report = run_surgery(source, model_dir, options=options, progress=False)
        record["seconds"]["surgery"] = time.time() - started
        record["stage"] = "scoring"
        started = time.time()
        record["scores"] = cell_scores(model_dir, report, cell["scoring"], cell["seed"])
        record["seconds"]["scoring"] = time.time() - started
        record.update(status="done", stage=None)
    except Exception as error:
        record.update(error=_error_text(error), traceback=traceback.format_exc())
    return record


# -------------------------------------------------------------------------------- driver side

def _gpus_per_task(ray, requested) -> float:
    if requested != "auto":
        return float(requested)
    return 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0


def run_sweep(spec: SweepSpec, output_dir: str, *, address: Optional[str] = None, progress: bool = True,
              log: Callable[[str], None] = LOG.info) -> Dict[str, Any]:
    """Run every cell not already done in ``output_dir/results.jsonl``; write results.jsonl,
    results.md, the plot and stats.json. Returns {"ran", "skipped", "failed", "records", ...}.

    Uses the running Ray if ``ray.init`` was called already, else ``ray.init(address)`` (None:
    a local instance; "auto" or "ray://host:10001": an existing cluster).
    """
    ray = import_ray()
    cells = expand(spec)
    validate(spec, cells)
    output_dir = os.path.abspath(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    results_path = os.path.join(output_dir, results_io.RESULTS)
    previous = results_io.read_records(results_path)
    finished = {h for h, record in previous.items() if record.get("status") == "done"}
    todo = [cell for cell in cells if cell.hash not in finished]
    log(f"sweep: {len(cells)} cells, {len(cells) - len(todo)} already done, {len(todo)} to run")
    records: List[Dict[str, Any]] = []
    try:
        if todo:
            if not ray.is_initialized():
                ray.init(address=address, runtime_env=worker_runtime_env(),
                         **({"include_dashboard": False} if address is None else {}))
            _run_cells(ray, spec, todo, output_dir, results_path, progress, records)
    finally:  # interrupted or not, the table and plot show every cell finished so far
        for record in records:
            previous[record["cell"]] = record
        results_io.write_outputs(output_dir, cells, previous, spec.sweep)
    failed = [r for r in records if r["status"] != "done"]
    return {"cells": len(cells), "ran": len(records), "skipped": len(cells) - len(todo),
            "failed": len(failed), "records": [previous[c.hash] for c in cells if c.hash in previous]}


def _run_cells(ray, spec: SweepSpec, todo: List[Cell], output_dir: str, results_path: str,
               progress: bool, records: List[Dict[str, Any]]) -> None:
    """Submit every cell, then record each as it finishes (appended to ``records`` and results.jsonl)."""
    from tqdm import tqdm

    resources = spec.sweep.resources
    request = {"num_cpus": resources.num_cpus, "num_gpus": _gpus_per_task(ray, resources.num_gpus)}
    if resources.memory_gb:
        request["memory"] = int(resources.memory_gb * 1024 ** 3)
    merge_remote = ray.remote(build_merge).options(**request, max_retries=0)
    cell_remote = ray.remote(run_cell).options(**request, max_retries=0)
    workdir = os.getcwd()
    surgery_defaults = {"cache_dir": os.path.join(output_dir, "capture_cache")}
    pending: Dict[Any, Cell] = {}
    for setting, group in group_by_merge(todo):
        merge_ref = merge_remote.remote(setting.config, os.path.join(output_dir, "merges", setting.hash),
                                        workdir, resources.num_cpus)
        for cell in group:
            ref = cell_remote.remote(
                merge_ref, {**cell.describe(), "scoring": cell.scoring}, setting.config,
                {**surgery_defaults, **cell.surgery}, os.path.join(output_dir, "cells", cell.hash),
                workdir, resources.num_cpus)
            pending[ref] = cell
    counts = {"done": 0, "failed": 0}
    bar = tqdm(total=len(pending), desc="sweep", unit="cell", disable=not progress, dynamic_ncols=True)
    bar.set_postfix(done=0, running=len(pending), failed=0)
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
        for ref in ready:
            cell = pending.pop(ref)
            try:
                record = ray.get(ref)
            except Exception as error:  # the worker itself died (killed for memory, node lost)
                record = {**cell.describe(), "scoring": cell.scoring, "status": "failed", "stage": "worker",
                          "error": f"{type(error).__name__}: {error}", "scores": {}}
            record.pop("scoring", None)
            results_io.append_record(results_path, record)
            counts["done" if record["status"] == "done" else "failed"] += 1
            records.append(record)
            if record["status"] != "done":
                LOG.warning("cell %s (%s, %s, seed %s) failed in %s: %s", cell.hash, cell.merge.label,
                            cell.variant.name, cell.seed, record.get("stage"), record["error"])
            bar.update(1)
        # "running" counts cells handed to Ray and not finished, including those waiting for resources
        bar.set_postfix(done=counts["done"], running=len(pending), failed=counts["failed"])
    bar.close()
