"""``mergekit-darts eval | compare | report``: task scores, multi-seed statistics, bias report.

Only click is imported at module level; the heavy libraries load when a command runs.
"""

import json
from typing import Dict, Optional, Tuple, Union

import click

from mergekit_darts.cli import read_config_file
from mergekit_darts.cli.repair import surgery_options, surgery_run_options

TASK_HELP = "Comma-separated lm-eval tasks: gsm8k_darts, humaneval_darts, alpaca_darts."


def _tasks(value: str) -> Tuple[str, ...]:
    from mergekit_darts.evaluation.harness import TASKS

    tasks = tuple(t.strip() for t in value.split(",") if t.strip())
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise click.BadParameter(f"unknown task(s) {bad or 'none'}; choose from {', '.join(TASKS)}", param_hint="--tasks")
    return tasks


def _data(values: Tuple[str, ...]) -> Union[None, str, Dict[str, str]]:
    """``--data PATH`` (the one data task) or repeated ``--data TASK=PATH``."""
    if not values:
        return None
    if len(values) == 1 and "=" not in values[0]:
        return values[0]
    pairs = {}
    for value in values:
        task, sep, path = value.partition("=")
        if not sep:
            raise click.BadParameter(f"{value!r}: with several files use TASK=PATH", param_hint="--data")
        pairs[task.strip()] = path
    return pairs


def _eval_options(func, with_device: bool = True):
    options = [
        click.option("--tasks", default="gsm8k_darts", show_default=True, help=TASK_HELP),
        click.option("--data", multiple=True, metavar="[TASK=]PATH",
                     help="Local JSONL: GSM8K format (question/answer with '#### n') for gsm8k_darts, "
                          "instruction records for alpaca_darts. Repeat as TASK=PATH for both."),
        click.option("--limit", type=int, default=None, help="Evaluate only the first N records of each task."),
        click.option("--allow-code-execution", is_flag=True,
                     help="Required for humaneval_darts: runs model-written code in a resource-limited sandbox."),
        click.option("--batch-size", default="1", show_default=True, help="lm-eval batch size (or 'auto')."),
        click.option("--max-gen-toks", type=int, default=None, help="New tokens per answer (default: the tasks' 512, or half the model's context when "
                          "that is shorter; it must leave room for the prompt)."),
        click.option("--chat-template", is_flag=True, help="Apply the tokenizer's chat template (instruction models)."),
    ]
    if with_device:  # compare gets --device from the surgery options instead
        options.append(click.option("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when present)."))
    for option in reversed(options):
        func = option(func)
    return func


def _compare_eval_options(func):
    return _eval_options(func, with_device=False)


def _evaluate_kwargs(data, limit, allow_code_execution, batch_size, max_gen_toks, chat_template, device=None) -> dict:
    return dict(data=_data(data), limit=limit, allow_code_execution=allow_code_execution,
                batch_size=int(batch_size) if batch_size.isdigit() else batch_size, device=device,
                max_gen_toks=max_gen_toks, apply_chat_template=chat_template)


@click.command("eval")
@click.argument("out_path", metavar="OUT_PATH")
@click.option("--domain", required=True, help="darts_domain to activate ('none' = the plain merged model).")
@_eval_options
@click.option("--compare-none", is_flag=True, help="Also evaluate darts_domain=none and print both.")
@click.option("--trust-remote-code", is_flag=True,
              help="Run OUT_PATH's own modeling code (needed for any --domain but none), as transformers requires.")
@click.option("--output-dir", default=None, metavar="DIR",
              help="Write results.json (and alpaca_outputs.<domain>.json for alpaca_darts) here.")
def eval_command(out_path: str, domain: str, tasks: str, compare_none: bool, trust_remote_code: bool,
                 output_dir: Optional[str], **kwargs):
    """Score OUT_PATH with one domain active on GSM8K / HumanEval / instruction tasks (lm-eval, offline).

    \b
    alpaca_darts scores offline only as sanity checks (exact match to a reference 'output' where
    given, non-empty rate, mean words). For AlpacaEval's judged win rate, export the generations
    with --output-dir and run (needs OPENAI_API_KEY):
        alpaca_eval --model_outputs DIR/alpaca_outputs.<domain>.json
    """
    from mergekit_darts.evaluation.harness import EvaluationError, evaluate, results_table
    from mergekit_darts.output.check import check_output_dir

    task_list = _tasks(tasks)
    check_output_dir(out_path, darts=domain != "none", code=domain != "none" and trust_remote_code)
    domains = (["none"] if compare_none and domain != "none" else []) + [domain]
    options = _evaluate_kwargs(**kwargs)
    try:
        runs = [evaluate(out_path, d, task_list, outputs_dir=output_dir, trust_remote_code=trust_remote_code,
                         **options) for d in domains]
    except EvaluationError as error:
        raise click.UsageError(str(error)) from None
    click.echo("\n" + results_table(runs))  # a newline: progress bars leave the cursor mid-line
    if output_dir:
        import os

        path = os.path.join(output_dir, "results.json")
        os.makedirs(output_dir, exist_ok=True)
        with open(path, "w", encoding="utf-8") as handle:
            json.dump([{k: v for k, v in r.items() if k != "alpaca_outputs"} for r in runs], handle, indent=2)
        click.echo(f"results written to {path}")


def _groups(value: str) -> Dict[str, Dict[str, str]]:
    from mergekit_darts.config import LOSSES, METHODS

    groups = {}
    for item in (part.strip() for part in value.split(",") if part.strip()):
        method, _, loss = item.partition("+")
        if method not in METHODS or loss not in LOSSES:
            raise click.BadParameter(
                f"{item!r}: expected METHOD+LOSS with METHOD in {METHODS} and LOSS in {LOSSES}",
                param_hint="--groups")
        groups[item] = {"method": method, "loss": loss}
    if len(groups) < 2:
        raise click.BadParameter("give at least two groups to compare", param_hint="--groups")
    return groups


@click.command("compare")
@click.argument("config_file", metavar="CONFIG_FILE")
@click.argument("out_path", metavar="MERGED_PATH")
@click.option("--seeds", type=click.IntRange(min=1), default=6, show_default=True, help="Calibration seeds per group.")
@click.option("--first-seed", type=int, default=0, show_default=True)
@click.option("--groups", default="standard+l1,darts+ewl1", show_default=True,
              help="Comma-separated METHOD+LOSS groups to compare, e.g. standard+l1,darts+ewl1,darts+kl.")
@click.option("--demo", is_flag=True, help="Score with the offline demo family's test sets.")
@click.option("--demo-seed", type=int, default=0, show_default=True, help="Seed of the demo's test splits.")
@_compare_eval_options
@click.option("--json", "json_path", default="darts_compare.json", show_default=True, help="Where to write the JSON.")
@click.option("--in-place", is_flag=True,
              help="Train in MERGED_PATH itself, replacing its surgery (default: in a scratch copy beside it).")
@click.option("--restore/--no-restore", default=True, show_default=True,
              help="With --in-place: retrain the config's own surgery at the end so MERGED_PATH matches CONFIG_FILE.")
@surgery_options
def compare_command(config_file: str, out_path: str, seeds: int, first_seed: int, groups: str, demo: bool,
                    demo_seed: int, tasks: str, json_path: str, in_place: bool, restore: bool, device, cuda,
                    random_seed, trust_remote_code, quiet, **kwargs):
    """Surgery variants over several calibration seeds: standard + L1 vs DARTS + EWL1 by default.

    \b
    Trains both once per seed on a scratch copy of MERGED_PATH (weights hard-linked, deleted at the
    end; MERGED_PATH is left as it is), hidden states cached so reruns only train; scores each run
    and reports per-seed scores, Shapiro-Wilk per group and a two-sided Mann-Whitney U test.
    Scores: lm-eval --tasks when given explicitly, --demo accuracies, or by default the held-out
    bias after surgery from each run's report (lower is better).
    """
    import contextlib
    import os

    from mergekit_darts.cli.scratch import scratch_copy
    from mergekit_darts.evaluation.compare import compare_table, demo_scorer, heldout_scorer, run_compare, task_scorer

    options = surgery_run_options(device, cuda, random_seed, trust_remote_code, quiet)
    source = read_config_file(config_file)
    ctx = click.get_current_context()
    explicit_tasks = ctx.get_parameter_source("tasks") is not click.core.ParameterSource.DEFAULT
    if demo and explicit_tasks:
        raise click.UsageError("give either --tasks or --demo, not both")
    if demo:
        scorer = demo_scorer(demo_seed)
    elif explicit_tasks:
        scorer = task_scorer(_tasks(tasks), **_evaluate_kwargs(**kwargs))
    else:
        scorer = heldout_scorer
    groups = _groups(groups)
    if not os.path.isfile(os.path.join(out_path, "config.json")):
        raise click.BadParameter(f"{out_path!r} is not a merged model directory (no config.json)",
                                 param_hint="MERGED_PATH")
    if in_place:
        click.echo(f"compare: training in {out_path} itself (--in-place): its surgery is replaced by each run"
                   + ("; the config's own is retrained at the end" if restore else " and the last one stays"))
        where = contextlib.nullcontext(out_path)
    else:
        click.echo(f"compare: training in a scratch copy of {out_path} (weights hard-linked, deleted at the end); "
                   f"{out_path} is left as it is")
        where = scratch_copy(out_path)
    with where as work:
        result = run_compare(source, work, seeds=seeds, first_seed=first_seed, scorer=scorer, groups=groups,
                             restore=restore and in_place, options=options, log=click.echo)
    replaced = os.path.exists(json_path)
    with open(json_path, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2)
    click.echo("\n" + compare_table(result))
    click.echo(f"results written to {json_path}" + (" (replacing the earlier file)" if replaced else ""))


@click.command("report")
@click.argument("out_path", metavar="OUT_PATH")
@click.option("--plot/--no-plot", default=None,
              help="Re-draw darts_bias.png (default: only when it is missing or older than darts_report.json).")
def report_command(out_path: str, plot: Optional[bool]):
    """Print the bias table of OUT_PATH/darts_report.json; re-draw OUT_PATH/darts_bias.png if stale."""
    import os

    from mergekit_darts.output.check import check_directory
    from mergekit_darts.output.layout import PLOT, REPORT
    from mergekit_darts.repair.report.table import render_report

    check_directory(out_path)
    figure, report = os.path.join(out_path, PLOT), os.path.join(out_path, REPORT)
    stale = not os.path.exists(figure) or (os.path.exists(report) and os.path.getmtime(figure) < os.path.getmtime(report))
    draw = stale if plot is None else plot
    try:
        click.echo(render_report(out_path, plot=draw))
    except (FileNotFoundError, ValueError) as error:
        raise click.ClickException(str(error)) from None
    if draw:
        click.echo(f"\nre-drew {figure}")
    elif plot is None:
        click.echo(f"\n{figure} is up to date (--plot re-draws it)")
