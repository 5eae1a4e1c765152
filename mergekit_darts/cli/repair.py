"""``mergekit-darts run | surgery | info``: merge and repair, repair only, describe an output."""

import json
from types import SimpleNamespace

import click

from mergekit_darts.cli import read_config_file
from mergekit_darts.cli.merge_options import PrettyPrintHelp, add_merge_options


def surgery_options(func):
    """The options that mean something to a surgery-only run (mergekit's merge options do not)."""
    options = [
        click.option("--device", default=None, help="Device for capture and training (cpu, cuda, cuda:N); "
                                                    "the surgery block's own device: wins."),
        click.option("--cuda", is_flag=True, help="Same as --device cuda."),
        click.option("--random-seed", type=int, default=None, help="Seed when the surgery block sets none."),
        click.option("--trust-remote-code", is_flag=True, help="Allow the models' own code to run when loading."),
        click.option("--quiet", is_flag=True, help="No progress bars (the per-domain results and router lines are "
                                                   "still printed)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def surgery_run_options(device, cuda, random_seed, trust_remote_code, quiet) -> SimpleNamespace:
    """What ``RunSettings.resolve`` reads from mergekit's MergeOptions, for surgery-only commands."""
    return SimpleNamespace(device=device, cuda=cuda, random_seed=random_seed,
                           trust_remote_code=trust_remote_code, quiet=quiet)


@click.command("run", cls=PrettyPrintHelp)
@click.argument("config_file", metavar="CONFIG_FILE")
@click.argument("out_path", metavar="OUT_PATH")
@add_merge_options
def run_command(merge_options, config_file: str, out_path: str):
    """Merge CONFIG_FILE into OUT_PATH, then run its surgery: block (like mergekit-yaml).

    \b
    CONFIG_FILE  a mergekit YAML with a surgery: block
    OUT_PATH     the output directory (a loadable model directory when this ends)
    """
    from mergekit_darts.errors import SurgeryConfigError
    from mergekit_darts.hook import original_run_merge
    from mergekit_darts.pipeline import merge_and_repair, parse_config_source

    merge_options.apply_global_options()
    source = read_config_file(config_file)
    _, surgery = parse_config_source(source)
    if surgery is None:
        raise SurgeryConfigError(f"{config_file}: no surgery: block; use mergekit-yaml for a plain merge")
    merge_and_repair(source, out_path, original_run_merge(), options=merge_options)  # ends "written to OUT_PATH"


@click.command("surgery")
@click.argument("config_file", metavar="CONFIG_FILE")
@click.argument("out_path", metavar="MERGED_PATH")
@surgery_options
def surgery_command(config_file: str, out_path: str, **options):
    """Run only the surgery: block of CONFIG_FILE on an existing merged directory MERGED_PATH.

    \b
    CONFIG_FILE  a mergekit YAML with a surgery: block (its merge part is not used)
    MERGED_PATH  a merged model directory; it becomes the repaired output
    """
    from mergekit_darts.output.layout import is_darts_dir, read_darts_entry
    from mergekit_darts.pipeline import print_summary, run_surgery, say

    if is_darts_dir(out_path):
        domains = ", ".join(read_darts_entry(out_path).get("domains") or {}) or "none"
        say(f"{out_path} holds an earlier surgery (domains {domains}); it is replaced when this one has finished")
    report = run_surgery(read_config_file(config_file), out_path, options=surgery_run_options(**options))
    print_summary(report)  # as mergekit-yaml and `run` print it; --quiet hides progress, not results
    say(f"surgery written to {out_path}")


@click.command("info")
@click.argument("out_path", metavar="OUT_PATH")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def info_command(out_path: str, as_json: bool):
    """Domains, experts, parameter counts and report summary of a repaired directory OUT_PATH."""
    from mergekit_darts.cli.describe import info_lines
    from mergekit_darts.output.check import check_output_dir
    from mergekit_darts.output.info import read_darts_info
    from mergekit_darts.repair.budget import share_of_7b

    check_output_dir(out_path)  # a missing shard or a newer format: one line, before anything loads
    info = read_darts_info(out_path)
    # what these settings would add per domain to a 7B-shaped model (the budget: 0.1 % per domain)
    info["share_7b"] = share_of_7b(info)
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    for line in info_lines(info):
        click.echo(line)
