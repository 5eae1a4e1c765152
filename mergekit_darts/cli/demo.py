"""``mergekit-darts demo``: the whole story on a tiny model family, on CPU, in one command."""

import click


@click.command("demo")
@click.option("--workdir", default="./darts_demo", show_default=True, type=click.Path(file_okay=False),
              help="Where the family, data, merged model and results go (the family is reused).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for data, training and surgery.")
@click.option("--quick", is_flag=True, help="A reduced run (smaller family, fewer steps and test problems).")
def demo_command(workdir: str, seed: int, quick: bool):
    """Train a tiny Llama family (base + math/code/instruct experts) on CPU, merge it with
    mergekit (task arithmetic), repair it with DARTS and the baselines, and print Table 1."""
    import logging
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from mergekit_darts.demo.run import run_demo

    result = run_demo(workdir, seed=seed, quick=quick, log=click.echo)
    click.echo(f"Results: {os.path.join(os.path.abspath(workdir), 'results.md')} (and results.json, "
               f"darts_bias.png); total {sum(result['timings_s'].values()):.0f}s")


if __name__ == "__main__":
    demo_command()
