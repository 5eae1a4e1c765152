"""The ``mergekit-darts`` command line (click, like mergekit's own scripts)."""

import json

import click
from mergekit.options import MergeOptions, PrettyPrintHelp, add_merge_options

from .config import SurgeryConfigError


@click.group("mergekit-darts")
@click.version_option(package_name="mergekit-darts")
def main():
    """DARTS representation surgery for mergekit merges.

    An unchanged `mergekit-yaml cfg.yml out/` already runs the surgery: block of cfg.yml; these
    commands are for running the steps explicitly and inspecting the result.
    """


def _read(config_file: str) -> str:
    try:
        with open(config_file, "r", encoding="utf-8") as handle:
            return handle.read()
    except OSError as error:
        raise click.BadParameter(f"cannot read {config_file!r}: {error.strerror}", param_hint="CONFIG_FILE")


@main.command("run", cls=PrettyPrintHelp)
@click.argument("config_file", metavar="CONFIG_FILE")
@click.argument("out_path", metavar="OUT_PATH")
@add_merge_options
def run_command(merge_options: MergeOptions, config_file: str, out_path: str):
    """Merge CONFIG_FILE into OUT_PATH, then run its surgery: block (like mergekit-yaml)."""
    from .pipeline import merge_and_repair, parse_config_source

    merge_options.apply_global_options()
    source = _read(config_file)
    _, surgery = parse_config_source(source)
    if surgery is None:
        raise SurgeryConfigError(f"{config_file}: no surgery: block; use mergekit-yaml for a plain merge")
    merge_and_repair(source, out_path, options=merge_options)
    click.echo(f"Repaired merge written to {out_path}")


@main.command("surgery", cls=PrettyPrintHelp)
@click.argument("config_file", metavar="CONFIG_FILE")
@click.argument("out_path", metavar="MERGED_PATH")
@add_merge_options
def surgery_command(merge_options: MergeOptions, config_file: str, out_path: str):
    """Run only the surgery: block of CONFIG_FILE on an existing merged directory MERGED_PATH."""
    from .pipeline import run_surgery

    merge_options.apply_global_options()
    report = run_surgery(_read(config_file), out_path, options=merge_options)
    for name, entry in report["domains"].items():
        bias = entry["bias"]
        click.echo(f"{name}: held-out bias {bias['mean_before']:.4f} -> {bias['mean_after']:.4f}")
    click.echo(f"Surgery written to {out_path}")


@main.command("info")
@click.argument("out_path", metavar="OUT_PATH")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def info_command(out_path: str, as_json: bool):
    """Domains, experts, parameter counts and report summary of a repaired directory."""
    from .export import read_darts_info

    try:
        info = read_darts_info(out_path)
    except (OSError, ValueError) as error:
        raise click.ClickException(str(error)) from None
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    for key, value in info.items():
        if key != "domains":
            click.echo(f"{key}: {value}")
    for name, entry in info.get("domains", {}).items():
        line = f"domain {name}: expert {entry.get('expert')}, {entry.get('parameters', 0):,} parameters"
        calibration = entry.get("calibration")
        if calibration:
            line += f", calibration {calibration.get('train')} train / {calibration.get('held_out')} held-out"
        bias = entry.get("bias")
        if bias and bias.get("mean_before") is not None:
            line += f", held-out bias {bias['mean_before']:.4f} -> {bias['mean_after']:.4f}"
        click.echo(line)


from .demo.cli import demo_command  # noqa: E402
from .eval_cli import compare_command, eval_command, report_command  # noqa: E402

main.add_command(demo_command)
main.add_command(eval_command)
main.add_command(compare_command)
main.add_command(report_command)
