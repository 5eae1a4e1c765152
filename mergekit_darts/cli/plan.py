"""``mergekit-darts plan CONFIG_FILE``: will the run fit, how long will it take (an estimate, before any weight
is read). Reads the YAML and each model's config.json (a local folder, or a Hub id: config.json only,
from the cache when offline)."""

from typing import Dict, List

import click

from mergekit_darts.plan import CARDS, GB, USABLE

FIT_CARDS = ("rtx4090", "l40s", "h100", "h200")  # 24 / 48 / 80 / 141 GB


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _gb(value: float) -> str:
    return f"{value / GB:.1f} GB" if value < 10 * GB else f"{value / GB:.0f} GB"


def _model_config(path: str, where: str):
    from mergekit_darts.preflight import load_model_config

    return load_model_config(path, where, trust_remote_code=False)  # config.json only: no weight is read


def _merged_model(merge_part: dict) -> str:
    """The model whose shape the merge has: the base model, else the first one listed."""
    if merge_part.get("base_model"):
        return str(merge_part["base_model"])
    for entry in merge_part.get("models") or []:
        model = entry.get("model") if isinstance(entry, dict) else None
        if model:
            return str(model)
    for piece in merge_part.get("slices") or []:
        for source in piece.get("sources") or []:
            if source.get("model"):
                return str(source["model"])
    raise click.UsageError("config: no base_model, models or slices to read the merged model's shape from")


def _input_models(merge_part: dict) -> int:
    models = {str(e.get("model")) for e in merge_part.get("models") or [] if isinstance(e, dict)}
    models |= {str(s.get("model")) for p in merge_part.get("slices") or [] for s in p.get("sources") or []}
    return len(models | ({str(merge_part["base_model"])} if merge_part.get("base_model") else set()))


def plan_report(config_source: str, card_name: str, tokens=None) -> dict:
    """The plan as data: the shape, one entry per domain, the merge and the fit on each card size."""
    from mergekit_darts.pipeline import parse_config_source
    from mergekit_darts.plan import Shape, advice, merge_seconds, plan_domain, run_from_surgery

    merge_part, surgery = parse_config_source(config_source)
    if surgery is None:
        raise click.UsageError("config: no surgery: block; a plain merge costs what mergekit costs")
    merged = _merged_model(merge_part)
    shape = Shape.from_config(_model_config(merged, "config.base_model"))
    for name, domain in surgery.domains.items():  # the experts' shapes are the merge's (preflight checks it)
        expert = Shape.from_config(_model_config(domain.model, f"surgery.domains.{name}.model"))
        if (expert.hidden, expert.layers, expert.vocab) != (shape.hidden, shape.layers, shape.vocab):
            raise click.UsageError(f"surgery.domains.{name}.model: {domain.model} has hidden {expert.hidden}, "
                                   f"{expert.layers} layers, vocabulary {expert.vocab}; the merge ({merged}) "
                                   f"{shape.hidden}, {shape.layers}, {shape.vocab}")
    card = CARDS[card_name]
    on_gpu = card_name != "cpu"
    domains = {}
    for name in surgery.domains:
        run = run_from_surgery(surgery, name, shape.layers, tokens, on_gpu=on_gpu)
        result = plan_domain(shape, run, card)
        result["advice"] = advice(shape, run, card, result)
        result["fit_on"] = {key: plan_domain(shape, run, CARDS[key]) for key in FIT_CARDS}
        result["run"] = run
        domains[name] = result
    return {"merged": merged, "shape": shape, "card": card, "surgery": surgery, "domains": domains,
            "merge_seconds": merge_seconds(shape, _input_models(merge_part)), "models": _input_models(merge_part)}


def _fit_cell(fits: List[dict]) -> str:
    """What training needs on one card over every domain: 'yes', the smallest micro-batch any domain
    needs, or 'no' when one domain does not fit even one record at a time."""
    short = [fit for fit in fits if not fit["fits"]]
    if any(fit["micro_batch_that_fits"] is None for fit in short):
        return "no"
    return f"micro_batch_size: {min(fit['micro_batch_that_fits'] for fit in short)}" if short else "yes"


def plan_lines(report: dict) -> List[str]:
    shape, card, surgery = report["shape"], report["card"], report["surgery"]
    first = next(iter(report["domains"].values()))["run"]
    lines = [f"plan on {card.name} - an ESTIMATE from the configs (docs/scale.md#before-the-run-plan), "
             f"every record at {first.tokens} tokens, every step run; memory counts the tensors, not the "
             "allocator's cache (small runs measured up to 2-4x it: leave headroom)",
             f"merged model {report['merged']}: {shape.parameters / 1e9:.2f} B parameters, hidden {shape.hidden}, "
             f"{shape.layers} layers, vocabulary {shape.vocab}",
             f"surgery: loss {surgery.loss}, {first.depth} adapted block(s)"
             + (f" ({first.stepped} trained, the rest at their extract)" if first.trained is not None else "")
             + f", {surgery.steps} steps"
             + (" with early stopping" + (" and a refit" if surgery.refit else "") if surgery.early_stopping else "")
             + (f", preset {surgery.preset}" if surgery.preset else ""),
             f"  merge (mergekit, {report['models']} models read): {_minutes(report['merge_seconds'])}"]
    total = report["merge_seconds"]
    for name, result in report["domains"].items():
        run = result["run"]
        seconds = sum(result[stage]["seconds"] for stage in ("capture", "delta start", "training"))
        total += seconds
        lines.append(f"  domain {name} ({run.records} records): capture {_minutes(result['capture']['seconds'])} "
                     f"({_gb(result['capture']['bytes'])}), delta start {_minutes(result['delta start']['seconds'])}, "
                     f"training {_minutes(result['training']['seconds'])} ({_gb(result['training']['bytes'])}"
                     + (f" at micro_batch_size {run.micro_batch}" if run.micro_batch else "") + ")")
        parts = result["training"]["parts"]
        lines.append("    training memory: " + ", ".join(f"{k} {_gb(v)}" for k, v in parts.items() if v))
        lines += [f"    to fit: {line}" for line in result["advice"]]
    lines.append(f"  total: {_minutes(total)} on one {card.name}")
    fits: Dict[str, List[dict]] = {}
    for result in report["domains"].values():
        for key, fit in result["fit_on"].items():
            fits.setdefault(key, []).append(fit)
    lines.append(f"training fits ({100 * USABLE:.0f} % of each card's memory): "
                 + " | ".join(f"{CARDS[key].memory_gb:g} GB: {_fit_cell(fit)}" for key, fit in fits.items()))
    return lines


@click.command("plan")
@click.argument("config_file", metavar="CONFIG_FILE")
@click.option("--gpu", "card", type=click.Choice(sorted(CARDS)), default="h100", show_default=True,
              help="The card the minutes are for (cpu: this project's 2-core machine).")
@click.option("--tokens", type=click.IntRange(1), default=None,
              help="Positions per calibration record (default: surgery.max_positions, an upper bound).")
def plan_command(config_file: str, card: str, tokens):
    """Print the memory and minutes CONFIG_FILE's merge and surgery will take, per stage and per domain,
    and which settings make training fit a 24 / 48 / 80 / 141 GB card. Reads only config files."""
    from mergekit_darts.cli import read_config_file

    report = plan_report(read_config_file(config_file), card, tokens)
    for line in plan_lines(report):
        click.echo(line)
