"""``mergekit-darts demo``: the whole story on a tiny model family, on CPU, in one command;
``mergekit-darts example``: the offline example's files, to run ``mergekit-yaml`` on."""

import os

import click

# Wall seconds of `mergekit-darts demo` on this project's 2-core CPU machine, (first run, rerun with
# the family reused): 430 s measured on 2026-12-03 with nothing else running, `preset: best` included
# (docs/results.md "Times"), and that run less the 117 s its family training took. Printed as an
# estimate. --quick was timed only on a machine loaded 9x over its cores: not an estimate worth printing.
MEASURED_S = {False: (430, 313), True: None}


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def plan_lines(workdir: str, quick: bool, all_rows: bool = False) -> list:
    """What the demo will do, in order, and an estimate of how long it takes; said before it starts."""
    from mergekit_darts.demo.run import PRESET_YAML, DemoSizes, surgery_rows
    from mergekit_darts.demo.tasks import DOMAINS

    sizes = DemoSizes.quick() if quick else DemoSizes()
    family = os.path.join(workdir, "family")
    reuse = os.path.exists(os.path.join(family, "family.json"))
    lines = [f"mergekit-darts demo{' --quick' if quick else ''}: DARTS on a tiny model family, on the CPU, "
             "nothing downloaded",
             f"  1. {'reuse' if reuse else 'train'} a tiny Llama base and "
             f"{len(DOMAINS)} experts ({', '.join(DOMAINS)}): {family}",
             "  2. merge them with mergekit (task arithmetic) and repair the merge, as mergekit-yaml would:",
             f"     {os.path.join(workdir, 'demo.yml')} -> {os.path.join(workdir, 'merged')}",
             f"  3. retrain the surgery for {len(surgery_rows(all_rows))} more variants"
             f"{'' if all_rows else f' (--all-rows: {len(surgery_rows(True))})'}, then `preset: best`",
             f"     ({os.path.join(workdir, PRESET_YAML)}) with 50 prompts per domain"
             + (f" and with {sizes.synthesize} more the base writes" if all_rows else
                f" (--all-rows: and with {sizes.synthesize} more)"),
             f"  4. score the base, the experts, the merge and every variant on {sizes.test} test problems per domain;",
             f"     write {os.path.join(workdir, 'results.md')}, results.json and darts_bias.png"]
    if os.path.exists(os.path.join(workdir, "results.md")):
        lines.append(f"  (an earlier demo's results in {workdir} are replaced)")
    measured = None if all_rows else MEASURED_S[quick]  # --all-rows was not timed: no estimate
    if measured:
        lines.append(f"  estimate: about {_minutes(measured[1] if reuse else measured[0])} on a 2-core CPU "
                     f"({'family reused' if reuse else 'first run, family trained'}; docs/results.md#times)")
    return lines


@click.command("demo")
@click.option("--workdir", default="./darts_demo", show_default=True, type=click.Path(file_okay=False),
              help="Where the family, data, merged model and results go (the family is reused).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for data, training and surgery.")
@click.option("--quick", is_flag=True, help="A reduced run (smaller family, fewer steps and test problems).")
@click.option("--all-rows", is_flag=True,
              help="Also retrain the paper's ablations and the quality options that docs/results.md#the-demo "
                   "holds (seven more surgeries) and `preset: best` with 450 prompts the base writes per domain "
                   "(synthesize); well over the default run's time.")
@click.option("--quiet", is_flag=True, help="No progress bars (the stage lines and tables are still printed). "
                                            "When stderr is not a terminal, long stages print a line every few "
                                            "seconds there instead of a bar; --quiet turns that off too.")
def demo_command(workdir: str, seed: int, quick: bool, all_rows: bool, quiet: bool):
    """Train a tiny Llama family (base + math/code/instruct experts) on CPU, merge it with
    mergekit (task arithmetic), repair it with DARTS, DARTS + KL, the data-free extract and
    `preset: best` (what the README recommends), and print the scores beside the README's."""
    import logging

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from mergekit_darts.demo.run import run_demo

    for line in plan_lines(workdir, quick, all_rows):
        click.echo(line)
    from mergekit_darts.settings import stderr_is_terminal

    from transformers.utils import logging as hf_logging

    terminal = stderr_is_terminal()
    if quiet or not terminal:  # transformers' bar of every model load, one per row scored, in a log file
        hf_logging.disable_progress_bar()
    result = run_demo(workdir, seed=seed, quick=quick, log=click.echo, all_rows=all_rows,
                      progress=not quiet and terminal, lines=not quiet and not terminal)
    click.echo(f"Results: {os.path.join(os.path.abspath(workdir), 'results.md')} (and results.json, "
               f"darts_bias.png); total {sum(result['timings_s'].values()):.0f}s")


@click.command("example")
@click.option("--dir", "dest", default=".", show_default=True, type=click.Path(file_okay=False),
              help="Where tiny_family/ and tiny_offline.yml go.")
@click.option("--force", is_flag=True, help="Replace a tiny_offline.yml that differs from the example.")
def example_command(dest: str, force: bool):
    """Write the offline example into --dir: tiny_family/ (a random tiny Llama base, math and code
    experts, math calibration prompts; nothing is downloaded) and tiny_offline.yml, a mergekit YAML
    with a surgery: block. Then run: mergekit-yaml tiny_offline.yml out"""
    from transformers.utils import logging as hf_logging

    from mergekit_darts.demo.offline import write_offline_example

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # transformers' save/load bars of each tiny model say nothing here
    try:
        written = write_offline_example(dest, force=force)
    except FileExistsError as error:
        raise click.ClickException(str(error)) from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    family = "kept the existing" if written["reused_family"] else "wrote"
    click.echo(f"{family} {written['family']}/ (random tiny base + math/code experts) and wrote {written['config']}")
    out = os.path.join(dest, "out") if os.path.normpath(dest) != "." else "out"
    click.echo(f"next: mergekit-yaml {written['config'] if dest != '.' else 'tiny_offline.yml'} {out}")


if __name__ == "__main__":
    demo_command()
