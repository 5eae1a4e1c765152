"""The ``mergekit-darts`` command line: a click group whose commands are imported only when run.

``mergekit-darts --help`` and ``--version`` import neither torch nor mergekit; each command family
lives in its own module (like mergekit's ``scripts/``). Library errors (``DartsError``) become one
``Error: ...`` line here, nowhere deeper.
"""

import importlib

import click

from mergekit_darts import __version__

# name -> ("module:attribute", one-line help shown by --help without importing the module)
COMMANDS = {
    "plan": ("mergekit_darts.cli.plan:plan_command", "Memory and minutes of CONFIG_FILE per stage and domain (estimate)."),
    "run": ("mergekit_darts.cli.repair:run_command", "Merge CONFIG_FILE, then run its surgery: block."),
    "surgery": ("mergekit_darts.cli.repair:surgery_command", "Run only the surgery: block on a merged directory."),
    "info": ("mergekit_darts.cli.repair:info_command", "Domains, experts and parameter counts of an output."),
    "report": ("mergekit_darts.cli.evaluate:report_command", "Print the bias/KL report and re-draw its plot."),
    "eval": ("mergekit_darts.cli.evaluate:eval_command", "Task scores of one domain through lm-eval (offline)."),
    "compare": ("mergekit_darts.cli.evaluate:compare_command", "Surgery variants over several seeds, with tests."),
    "demo": ("mergekit_darts.cli.demo:demo_command", "The built-in demo on a tiny model family (CPU)."),
    "example": ("mergekit_darts.cli.demo:example_command", "Write the offline example: a tiny family and its YAML."),
    "bake": ("mergekit_darts.cli.serve:bake_command", "Fold one domain into the weights: a plain model directory."),
    "export-peft": ("mergekit_darts.cli.serve:export_peft_command", "One PEFT LoRA adapter per domain on the plain merge."),
    "serve": ("mergekit_darts.cli.route:serve_command", "Route OpenAI-style requests to a domain's LoRA in llama-server."),
    "export-gguf": ("mergekit_darts.cli.serve:export_gguf_command", "GGUF base + one LoRA GGUF per domain for llama.cpp / Ollama."),
    "sweep": ("mergekit_darts.cli.sweep:sweep_command", "A grid of merges x surgery variants x seeds on Ray."),
    "push": ("mergekit_darts.cli.hub:push_command", "Check an output directory, then upload it to the Hub."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return list(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module, _, attribute = COMMANDS[name][0].partition(":")
        return getattr(importlib.import_module(module), attribute)

    def format_commands(self, ctx, formatter):
        with formatter.section("Commands"):
            formatter.write_dl([(name, short) for name, (_, short) in COMMANDS.items()])

    def invoke(self, ctx):
        from mergekit_darts.console import filter_third_party_noise, user_logging
        from mergekit_darts.errors import DartsError, one_line_error, to_click_error

        filter_third_party_noise()  # before a command imports torch, transformers, bitsandbytes

        try:
            with user_logging():  # our warnings as "mergekit-darts: warning: ...", each once per run
                return super().invoke(ctx)
        except DartsError as error:
            raise to_click_error(error) from None
        except KeyboardInterrupt as error:  # Ctrl-C or SIGTERM (interrupts.py): one line, exit 130 / 143
            from mergekit_darts.interrupts import exit_interrupted

            exit_interrupted(error)
        except Exception as error:  # noqa: BLE001 - a full disk, a loader's ValueError: one line too
            failed = one_line_error(error, ctx.invoked_subcommand or "mergekit-darts")
            if failed is None:
                raise
            raise to_click_error(failed) from None


@click.group("mergekit-darts", cls=LazyGroup)
@click.version_option(__version__, prog_name="mergekit-darts")
@click.option("--verbose", is_flag=True,
              help="Also print the third-party warnings filtered by default (deprecations, optional kernels).")
def main(verbose: bool):
    """DARTS representation surgery for mergekit merges.

    An unchanged `mergekit-yaml cfg.yml out/` already runs the surgery: block of cfg.yml; these
    commands are for running the steps explicitly and inspecting the result.
    """
    if verbose:
        import os

        from mergekit_darts.console import VERBOSE_ENV

        os.environ[VERBOSE_ENV] = "1"


def read_config_file(config_file: str) -> str:
    try:
        with open(config_file, "r", encoding="utf-8") as handle:
            return handle.read()
    except OSError as error:
        raise click.BadParameter(f"cannot read {config_file!r}: {error.strerror}", param_hint="CONFIG_FILE")
