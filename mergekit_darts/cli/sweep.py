"""``mergekit-darts sweep``: a grid of merges × surgery variants × seeds on Ray (docs/sweep.md)."""

import click

from mergekit_darts.cli import read_config_file


@click.command("sweep")
@click.argument("sweep_file", metavar="SWEEP_FILE")
@click.option("--output-dir", "-o", default=None, metavar="DIR",
              help="Where results and models go (default: the YAML's sweep.output_dir, else sweep_<file name>).")
@click.option("--address", default=None, metavar="ADDRESS",
              help="Join a Ray cluster: 'auto' (this node's cluster) or 'ray://HOST:10001'. "
                   "Default: start a local Ray instance.")
@click.option("--dry-run", is_flag=True, help="List the cells (and which are already done) without running any.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def sweep_command(sweep_file: str, output_dir, address, dry_run: bool, quiet: bool):
    """Run every cell of SWEEP_FILE not already done: merge → surgery → scoring, one Ray task each.

    \b
    Re-running resumes: cells whose full config (content hash) is in DIR/results.jsonl as done are
    skipped; failed cells run again. Writes DIR/results.jsonl, results.md, sweep_plot.png, stats.json.
    """
    import logging
    import os

    from mergekit_darts.sweep.config import parse_sweep

    spec = parse_sweep(read_config_file(sweep_file), where=sweep_file)
    if output_dir is None:
        stem = os.path.splitext(os.path.basename(sweep_file))[0]
        output_dir = spec.sweep.output_dir or f"sweep_{stem}"
    if dry_run:
        _dry_run(spec, output_dir)
        return
    from mergekit_darts.sweep.runner import run_sweep

    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, format="%(message)s")
    outcome = run_sweep(spec, output_dir, address=address, progress=not quiet, log=click.echo)
    click.echo(f"sweep: {outcome['ran']} ran ({outcome['failed']} failed), {outcome['skipped']} skipped as done; "
               f"results in {os.path.join(output_dir, 'results.md')}")
    if outcome["failed"]:
        raise SystemExit(1)


def _dry_run(spec, output_dir: str) -> None:
    import os

    from mergekit_darts.sweep.grid import expand, validate
    from mergekit_darts.sweep.results import RESULTS, read_records

    cells = expand(spec)
    validate(spec, cells)
    done = {h for h, r in read_records(os.path.join(output_dir, RESULTS)).items() if r.get("status") == "done"}
    for cell in cells:
        state = "done" if cell.hash in done else "todo"
        click.echo(f"{cell.hash}  {state}  {cell.merge.label} | {cell.variant.name} | seed {cell.seed}")
    click.echo(f"{len(cells)} cells, {len(done & {c.hash for c in cells})} done")
