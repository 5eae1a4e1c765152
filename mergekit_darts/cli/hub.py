"""``mergekit-darts push``: publish a checked output directory to the Hugging Face Hub."""

import click


@click.command("push")
@click.argument("out_path", metavar="OUT_PATH")
@click.argument("repo_id", metavar="REPO_ID")
@click.option("--private", is_flag=True, help="Create the repository as private (an existing one keeps its setting).")
@click.option("--commit-message", default="Upload a mergekit-darts merge", show_default=True)
@click.option("--check-only", is_flag=True, help="Only check that OUT_PATH is complete; upload nothing.")
def push_command(out_path: str, repo_id: str, private: bool, commit_message: str, check_only: bool):
    """Upload OUT_PATH (a mergekit-darts output) to the Hub as REPO_ID (e.g. me/my-merge).

    \b
    OUT_PATH  the directory mergekit-yaml / mergekit-darts run wrote
    REPO_ID   the Hub model repository, created if it does not exist
    First checks that OUT_PATH is complete (no leftovers of an interrupted surgery, every shard
    present and whole, a readable darts entry, the model code and the model card), then uploads
    every file. Token: HF_TOKEN or `hf auth login`; endpoint: HF_ENDPOINT.
    """
    from mergekit_darts.output.push import check_publishable, push

    if check_only:
        summary = check_publishable(out_path)
        click.echo(f"{out_path}: complete ({summary['files']} files, {summary['bytes'] / 1e6:.1f} MB, "
                   f"domains {', '.join(summary['domains'])})")
        return
    result = push(out_path, repo_id, private=private, commit_message=commit_message)
    click.echo(f"uploaded {result['files']} files ({result['bytes'] / 1e6:.1f} MB) to {result['url']}")
