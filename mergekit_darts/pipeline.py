"""The one entrance: validate → merge → capture → train each domain → export (docs/design.md §4).

``merge_and_repair`` takes mergekit's own ``run_merge`` as an argument: the start-up hook passes the
function it wraps, the command line passes the unwrapped original. This module imports neither the
hook nor the command line. Settings (seed, device, dtype, trust_remote_code, progress) are resolved
once into a ``RunSettings`` here and handed to every step.
"""

import copy
import logging
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import yaml

from mergekit_darts.config import (SurgeryConfig, SurgeryConfigError, parse_surgery_block, preset_settings,
                                   split_yaml)
from mergekit_darts.console import before_after
from mergekit_darts.errors import io_error, yaml_error_line
from mergekit_darts.interrupts import describe, terminate_as_interrupt
from mergekit_darts.presets import fit_preset
from mergekit_darts.repair.route.step import router_step  # noqa: F401  (benchmarks import it from here)
from mergekit_darts.repair.stages import StageClock, stage_line
from mergekit_darts.repair.train.domain import train_domain
from mergekit_darts.settings import RunSettings

LOG = logging.getLogger(__name__)


def read_config_source(config_source: str) -> Tuple[Dict[str, Any], Any]:
    """(mergekit part of the YAML, raw surgery block or None); YAML errors as one line."""
    try:
        return split_yaml(config_source)
    except yaml.YAMLError as error:
        raise SurgeryConfigError(yaml_error_line(error)) from None


def parse_config_source(
    config_source: str, overrides: Optional[Dict[str, Any]] = None
) -> Tuple[Dict[str, Any], Optional[SurgeryConfig]]:
    """(mergekit part of the YAML, validated surgery block or None); ``overrides`` update ``surgery:``."""
    merge_part, surgery_raw = read_config_source(config_source)
    return merge_part, _surgery_block(surgery_raw, overrides)


def _surgery_block(surgery_raw: Any, overrides: Optional[Dict[str, Any]] = None) -> Optional[SurgeryConfig]:
    if surgery_raw is None:
        if overrides:
            raise SurgeryConfigError("surgery: the config has no surgery: block to override")
        return None
    if overrides:
        if not isinstance(surgery_raw, dict):
            raise SurgeryConfigError("surgery: expected a mapping")
        surgery_raw = {**copy.deepcopy(surgery_raw), **overrides}
    return parse_surgery_block(surgery_raw)


def merge_and_repair(config_source: str, out_path: str, run_merge: Callable, options=None,
                     merge_config=None) -> Optional[dict]:
    """What ``mergekit-yaml`` does with a ``surgery:`` block: validate everything (mergekit's part
    first), merge with ``run_merge`` (mergekit's), repair ``out_path``. Returns the surgery report, or
    None for a YAML without a surgery block (then this is exactly ``run_merge``)."""
    from mergekit.config import MergeConfiguration
    from mergekit.options import MergeOptions

    from mergekit_darts.preflight import check_before_merge, check_merge_config

    options = options or MergeOptions()
    merge_part, surgery_raw = read_config_source(config_source)
    if surgery_raw is None:
        run_merge(merge_config or MergeConfiguration.model_validate(merge_part), out_path, options, config_source)
        return None
    merge_config = check_merge_config(merge_part, options, merge_config)
    surgery = _surgery_block(surgery_raw)
    settings = RunSettings.resolve(surgery, options)
    with terminate_as_interrupt():  # SIGTERM cleans up as Ctrl-C does (interrupts.py)
        try:  # a typo costs seconds, not a 70B merge
            texts = check_before_merge(surgery, merge_config, settings, out_path=out_path, options=options)
        except KeyboardInterrupt as error:
            describe(error, f"before the merge: {out_path} is unchanged")
            raise
        earlier = describe_earlier_result(out_path)
        if earlier:
            say(f"{out_path} holds {earlier}; it is replaced when this run has finished (and kept if it fails)")
        report = _merge_and_repair_staged(config_source, out_path, run_merge, options, merge_config, surgery,
                                          settings, texts)
    print_summary(report)  # the results, also with --quiet (which hides progress only)
    say(f"repaired merge written to {out_path}")
    return report


def say(line: str) -> None:
    """One line of what a run did, as every command and mergekit-yaml print it (stderr, prefixed:
    stdout stays for the commands' own results)."""
    print(f"mergekit-darts: {line}", file=sys.stderr, flush=True)


def print_summary(report: dict) -> None:
    for line in summary_lines(report):
        say(line)


def describe_earlier_result(path: str) -> Optional[str]:
    """What a run over ``path`` replaces, in words ("a repaired merge (domains math, code)"), or
    None when there is nothing there."""
    from mergekit_darts.output import layout

    if not os.path.isdir(path) or not os.listdir(path):
        return None
    if layout.is_darts_dir(path):
        domains = layout.read_darts_entry(path).get("domains") or {}
        return f"an earlier repaired merge (domains {', '.join(domains) or 'none'})"
    if os.path.isfile(os.path.join(path, "config.json")):
        return "an earlier model (a plain merge?)"
    return f"{len(os.listdir(path))} earlier file(s)"


def _merge_and_repair_staged(config_source, out_path, run_merge, options, merge_config, surgery, settings,
                             texts) -> dict:
    """Merge and repair in a staging sibling; ``out_path`` changes only when both succeeded, so a
    failed run leaves it as it was, or (when it held nothing) as the plain merge of this config
    (docs/reliability.md)."""
    from mergekit_darts.output.staging import StagedOutput

    stage, clock = StagedOutput(out_path), StageClock(settings.device)
    try:
        with clock.stage("merge"):
            run_merge(merge_config, stage.path, options, config_source)
    except BaseException as error:
        stage.discard()
        if isinstance(error, KeyboardInterrupt):
            describe(error, f"during the merge: {out_path} is unchanged (the partial merge was removed)")
        failed = io_error(error, f"merge (staged for {out_path}, which is unchanged)")
        if failed is not None:  # a full disk: mergekit's raw SafetensorError/OSError as one line
            raise failed from None
        raise
    if not settings.quiet:
        say(f"merge written (staged for {out_path}); running {surgery.method} surgery on "
            f"{len(surgery.domains)} domain(s)")
    try:
        report = repair_directory(stage.path, surgery, settings, texts=texts, clock=clock)
    except BaseException as error:
        kept = stage.keep_plain_merge()
        if isinstance(error, KeyboardInterrupt):  # the command's one line says where things are
            describe(error, _interrupted_surgery(out_path, kept))
            raise
        if kept == os.path.realpath(out_path):
            LOG.error("Surgery failed; %s is left as the plain merged model. Fix the cause and run "
                      "`mergekit-darts surgery CONFIG %s` to repair it without merging again.", out_path, out_path)
        elif kept:
            LOG.error("Surgery failed; %s is unchanged. The new plain merge is kept at %s: repair it with "
                      "`mergekit-darts surgery CONFIG %s` and move it into place, or delete it.", out_path, kept, kept)
        failed = io_error(error, "surgery")
        if failed is not None:
            raise failed from None
        raise
    try:
        stage.commit()  # a signal waits for the switch and the deletion of the old contents (staging.py)
    except KeyboardInterrupt as error:
        describe(error, stage.interrupted_switch(out_path))
        raise
    return report


def _interrupted_surgery(out_path: str, kept: Optional[str]) -> str:
    """Where an interrupted surgery left things (``StagedOutput.keep_plain_merge``), as the error line says it."""
    if kept == os.path.realpath(out_path):
        return (f"during the surgery: {out_path} is left as the plain merge of this config; "
                f"`mergekit-darts surgery CONFIG {out_path}` repairs it without merging again")
    if kept:
        return (f"during the surgery: {out_path} is unchanged; the new plain merge is kept at {kept}: repair it with "
                f"`mergekit-darts surgery CONFIG {kept}` and move it into place, or delete it")
    return f"during the surgery: {out_path} is unchanged"


def summary_lines(report: dict) -> List[str]:
    """Per domain: held-out bias and KL to the expert, before -> after, and what decided the verdict."""
    from mergekit_darts.repair.report.table import baseline_line, blocks_line, no_regret_line
    from mergekit_darts.repair.report.verdict import STATUS_WORDS, verdict_note

    lines = []
    for name, entry in report["domains"].items():
        split = _split_label(entry)
        parts = [before_after(entry.get("bias"), f"{split} bias"),
                 before_after(entry.get("held_out_kl"), f"{split} KL to expert")]
        verdict = entry.get("verdict") or {}
        status = verdict.get("status", "improved")
        warning = "" if status == "improved" else f"  WARNING: {STATUS_WORDS.get(status, status)}"
        lines.append(f"{name}: " + ", ".join(part for part in parts if part) + warning)
        if verdict:
            lines.append(f"  verdict {status.replace('_', '-')}: {verdict_note(verdict)}")
        lines += blocks_line(entry) + no_regret_line(entry) + baseline_line(entry)
    default = report.get("default_domain")
    if isinstance(default, dict) and default.get("used") != default.get("requested"):
        lines.append(f"default domain: {default['used']} (requested {default['requested']}: {default.get('reason')})")
    if report.get("router"):
        from mergekit_darts.repair.route.router import summary_lines as router_lines

        lines += router_lines(report["router"])
    return lines + stage_line(report.get("stages"))


def run_surgery(
    config_source: str, out_path: str, *, overrides: Optional[Dict[str, Any]] = None, options=None,
    progress: Optional[bool] = None,
) -> dict:
    """Surgery only, on an existing merged directory ``out_path``; returns the report."""
    from mergekit_darts.preflight import check_surgery

    _, surgery = parse_config_source(config_source, overrides)
    if surgery is None:
        raise SurgeryConfigError("surgery: the config has no surgery: block")
    if not os.path.isfile(os.path.join(out_path, "config.json")):
        raise SurgeryConfigError(f"{out_path}: not a merged model directory (no config.json); run the merge first")
    settings = RunSettings.resolve(surgery, options, progress)
    texts = check_surgery(surgery, out_path, settings)
    try:
        with terminate_as_interrupt():  # SIGTERM cleans up as Ctrl-C does (interrupts.py)
            return repair_directory(out_path, surgery, settings, texts=texts)
    except KeyboardInterrupt as error:
        describe(error, f"during the surgery: {out_path} is left without this run's correction (the export "
                        "replaces its files in an order that keeps the folder loadable)")
        raise
    except Exception as error:  # e.g. a full disk during the export, which leaves out_path as it was
        failed = io_error(error, f"surgery ({out_path} is left as it was)")
        if failed is not None:
            raise failed from None
        raise


# ---------------------------------------------------------------------------------------------- steps

def repair_directory(out_path: str, surgery: SurgeryConfig, settings: RunSettings,
                     texts: Optional[Dict[str, List[str]]] = None, clock: Optional[StageClock] = None) -> dict:
    """capture → train each domain → export on a merged directory. Atomic: on failure ``out_path``
    stays a plain merge. ``texts``: each domain's calibration texts as the pre-merge checks loaded them;
    ``clock``: the run's stage clock (the merge's time already in it), timing each stage for the report."""
    surgery = resolve_from_model(surgery, out_path, settings.trust_remote_code)
    stage = say if settings.stage_lines else (lambda line: None)  # a log file gets lines, not bars
    stage(f"capturing hidden states: the merged model and {len(surgery.domains)} expert(s)")
    clock = clock or StageClock(settings.device)
    with clock.stage("capture"):
        ctx = capture_context(out_path, surgery, settings)
        captured = capture_step(out_path, surgery, settings, texts, ctx=ctx)
    modules, report = {}, {"surgery": {**surgery.model_dump(exclude={"domains"}), "seed": settings.seed},
                           "domains": {}}
    # a preset's settings as this run resolved them (explicit keys win), for the reader of the report
    report["surgery"]["preset_settings"] = preset_settings(surgery)
    if captured.tail is not None:  # the merged model's decoder layers: whether depth adapts all of them
        report["surgery"]["layers"] = captured.tail.first + len(captured.tail.layers)
    for name, data in captured.domains.items():
        with clock.stage(f"train:{name}"):
            trained = train_domain(name, data, captured.merged_head, surgery, settings, tail=captured.tail,
                                   merged_dir=out_path)
        modules[name] = trained.module
        report["domains"][name] = trained.entry
        LOG.info("domain %s: %s", name, before_after(trained.entry["bias"], f"{_split_label(trained.entry)} bias"))
        stage(f"domain {name} trained ({surgery.steps} steps)")
    if captured.tail is not None:
        report["depth"] = captured.tail.coverage()  # which weights of the adapted blocks carry adapters
    router = None
    if surgery.router_enabled:
        with clock.stage("router"):
            router, report["router"] = router_step(out_path, captured, surgery, settings, ctx=ctx)
    default = _checked_default(report, surgery)
    stage("exporting the corrections" + (" and the router" if router is not None else ""))
    report["stages"] = clock.as_report()  # the file's stages end here: the export writes it
    with clock.stage("export"):
        export_step(out_path, surgery, modules, report, router, default_domain=default)
    report["stages"] = clock.as_report()
    return report


def resolve_from_model(surgery: SurgeryConfig, model_dir: str, trust_remote_code: bool = False) -> SurgeryConfig:
    """The settings that depend on the merged model: ``depth: all`` made its number of decoder layers,
    and an unwritten ``max_positions`` its context length when that is below the default 512 (a
    default the user never wrote must not exceed the model; a written value is kept, with a warning)."""
    wants_positions = "max_positions" not in surgery.model_fields_set
    if surgery.depth != "all" and not wants_positions and surgery.preset is None:
        return surgery
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    update = {}
    if surgery.depth == "all":
        update["depth"] = int(config.num_hidden_layers)
    context = getattr(config, "max_position_embeddings", None)
    if wants_positions and isinstance(context, int) and 0 < context < surgery.max_positions:
        update["max_positions"] = context
    surgery = surgery.model_copy(update=update) if update else surgery
    return fit_preset(surgery, hidden_size=int(config.hidden_size))[0]  # a preset's ranks, at most the hidden size


def _split_label(entry: dict) -> str:
    """What the numbers were measured on: held-out records, or (held_out: 0, too few records) training ones."""
    return "held-out" if entry.get("bias_split", "held_out") == "held_out" else "training-records"


def _rounded(value) -> str:
    """A measured figure as the console prints it (4 significant digits, not 0.20707011222839355)."""
    return f"{value:.4g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def _checked_default(report: dict, surgery: SurgeryConfig) -> str:
    """The default domain, never silently one that made things worse (docs/reliability.md)."""
    from mergekit_darts.repair.report.verdict import STATUS_WORDS, choose_default

    for name, entry in report["domains"].items():
        verdict = entry["verdict"]
        if verdict["status"] != "improved":
            why = f"; {verdict['why']}" if verdict.get("why") else ""
            LOG.warning("domain %s: the correction is %s on %s (%s %s -> %s%s)", name,
                        STATUS_WORDS.get(verdict["status"], verdict["status"]).upper(), verdict["measured_on"],
                        verdict["metric"], _rounded(verdict["before"]), _rounded(verdict["after"]), why)
    default = choose_default(report, surgery.active_domain, surgery.allow_worse_default)
    if default != surgery.active_domain:
        LOG.warning("default domain %r is %s; the output loads as the plain merge ('none'). Set "
                    "surgery.allow_worse_default: true to keep it anyway.", surgery.active_domain,
                    report["default_domain"]["reason"])
    return default


def capture_context(out_path: str, surgery: SurgeryConfig, settings: RunSettings):
    """The one capture context of a run: every model load (domains, router_eval, depth) goes through it."""
    from mergekit_darts.repair.capture.context import open_run_context

    return open_run_context(out_path, surgery, settings)


def capture_step(out_path: str, surgery: SurgeryConfig, settings: RunSettings,
                 texts: Optional[Dict[str, List[str]]] = None, ctx=None):
    """Calibration texts (chat template applied) → merged and expert final states of every domain."""
    from mergekit_darts.repair.capture.calibration import apply_chat_template, load_calibration_texts
    from mergekit_darts.repair.capture.domains import DomainCaptureSpec, capture_domains

    from mergekit_darts.finite_states import check_finite_capture
    from mergekit_darts.preflight import truncate_texts

    ctx = ctx or capture_context(out_path, surgery, settings)
    if texts is None:
        texts = {name: load_calibration_texts(domain.calibration, settings.seed, f"surgery.domains.{name}.calibration")
                 for name, domain in surgery.domains.items()}
    texts = truncate_texts(surgery, texts, ctx.tokenizer)  # a no-op for texts the pre-merge checks cut already
    specs = []
    for name, domain in surgery.domains.items():
        where = f"surgery.domains.{name}.calibration"
        domain_texts = texts[name]
        if domain.calibration.chat_template:
            domain_texts = apply_chat_template(domain_texts, ctx.tokenizer, where=f"{where}.chat_template")
        specs.append(DomainCaptureSpec(name=name, expert=domain.model, texts=domain_texts,
                                       continue_tokens=domain.calibration.continue_tokens,
                                       continue_samples=domain.calibration.continue_samples,
                                       continue_temperature=domain.calibration.continue_temperature,
                                       sample_seed=settings.seed,
                                       synthesize=domain.calibration.synthesize,
                                       synthesize_temperature=domain.calibration.synthesize_temperature,
                                       synthesize_writer=domain.calibration.synthesize_writer,
                                       held_out=surgery.held_out,
                                       add_special_tokens=not domain.calibration.chat_template))
    captured = capture_domains(ctx, specs, depth=surgery.depth)
    check_finite_capture(captured, surgery, settings, out_path)
    return captured


def export_step(out_path: str, surgery: SurgeryConfig, modules: Dict[str, Any], report: dict,
                router=None, default_domain: Optional[str] = None) -> None:
    """The bias plot (best effort) and the atomic export of modules, report and card."""
    from mergekit_darts.output.export import export_surgery
    from mergekit_darts.repair.report.plot import plot_bias

    def draw(path: str) -> None:  # in the export's own staging folder inside out_path (never $TMPDIR)
        try:
            plot_bias(report, path)
        except Exception as error:  # a plot must never cost the user their surgery
            LOG.warning("could not draw darts_bias.png: %s", error)
            if os.path.exists(path):
                os.remove(path)

    export_surgery(out_path, modules, {name: d.model for name, d in surgery.domains.items()},
                   default_domain or surgery.active_domain, loss=surgery.loss, report=report,
                   extra_files={"darts_bias.png": draw}, router=router)
