"""``mergekit-darts bake | export-peft``: serve a repaired merge without remote code.

Only click is imported at module level; torch and the writers load when a command runs.
"""

import json
import os

import click

DROP_HELP = ("Fold a method: darts correction without its per-position bias table (it cannot be folded); "
             "prints the held-out KL to the expert with and without the table.")
DROP_FINAL_HELP = ("Export without the final-state correction (its ReLU content and position table have no weight "
                   "form; content: relu, preset: best before 2026-12-06): only the block adapters and the head correction, exactly. Prints what is "
                   "dropped and, when training measured it, the held-out KL to the expert with and without it.")

DROP_BIAS_HELP = ("Export the block adapters without their biases (Qwen2-style q/k/v: vLLM and llama.cpp take no LoRA "
                  "bias); prints the held-out KL to the expert with and without them.")


def _kl_lines(domain: str, kl) -> list:
    """What dropping the position table costs, as measured when the surgery was trained."""
    if not kl or "after_without_position_bias" not in kl:
        return [f"{domain}: dropped the position table; its effect was not measured (darts_report.json has no "
                "held_out_kl.after_without_position_bias: re-run the surgery with this mergekit-darts to measure it)"]
    return [f"{domain}: held-out KL to the expert (darts_report.json, measured on the held-out calibration records "
            f"at training): plain merge {kl['before']:.4f}, with position table {kl['after']:.4f}, "
            f"without it (what was folded) {kl['after_without_position_bias']:.4f}"]


def _echo_dropped(domain: str, summary: dict, block_linears: int, head_kept: bool) -> None:
    """What an export dropped of ``domain``'s correction and what that cost (bake's or export-peft's
    summary; they count the block linears and the head's rank under their own keys)."""
    from mergekit_darts.output.dropped import dropped_lines

    if summary["dropped_final_state"]:
        for line in dropped_lines(domain, summary["shape"], summary["hidden_size"], block_linears, head_kept,
                                  summary["held_out_kl"]):
            click.echo(line)
    elif summary["dropped_position_bias"]:
        for line in _kl_lines(domain, summary["held_out_kl"]):
            click.echo(line)
    if summary.get("dropped_lora_bias"):
        kl = summary["held_out_kl"] or {}
        cost = (f"held-out KL to the expert (darts_report.json, measured at training): plain merge {kl['before']:.4g}, "
                f"with the biases {kl['after']:.4g}, without them (what was exported) {kl['after_without_lora_bias']:.4g}"
                if "after_without_lora_bias" in kl else "their effect was not measured (darts_report.json has no "
                "held_out_kl.after_without_lora_bias: re-run the surgery with this mergekit-darts to measure it)")
        click.echo(f"{domain}: DROPPED the block adapters' biases (--drop-lora-bias); {cost}")


@click.command("bake")
@click.argument("out_path", metavar="OUT_PATH")
@click.argument("dest", metavar="DEST")
@click.option("--domain", required=True, help="The domain whose correction is folded into the LM head.")
@click.option("--drop-position-bias", is_flag=True, help=DROP_HELP)
@click.option("--drop-final-state-correction", "drop_final_state", is_flag=True, help=DROP_FINAL_HELP)
def bake_command(out_path: str, dest: str, domain: str, drop_position_bias: bool, drop_final_state: bool):
    """Write DEST: the merge in OUT_PATH as a plain model with DOMAIN's correction folded into its LM head
    (and, with depth, its block adapters into their linears).

    \b
    OUT_PATH  a repaired directory trained with `content: linear` (or any, with --drop-final-state-correction)
    DEST      a new directory (loads without trust_remote_code: vLLM, llama.cpp/GGUF conversion, ...)
    """
    from mergekit_darts.output.bake import bake
    from mergekit_darts.output.check import check_output_dir

    check_output_dir(out_path)
    summary = bake(out_path, domain, dest, drop_position_bias=drop_position_bias, drop_final_state=drop_final_state)
    _echo_dropped(domain, summary, summary["block_linears"], summary["head_rank"] > 0)
    folded = [f"lm_head from {summary['head_source']}"] if summary["head_source"] else ["lm_head unchanged"]
    folded += [f"{summary['block_linears']} block linears"] if summary["block_linears"] else []
    click.echo(f"Baked domain {domain!r} into {dest} ({', '.join(folded)})")


@click.command("export-peft")
@click.argument("out_path", metavar="OUT_PATH")
@click.argument("dest", metavar="DEST")
@click.option("--domain", "domains", multiple=True, help="Export only this domain (repeatable; default: all).")
@click.option("--drop-position-bias", is_flag=True, help=DROP_HELP)
@click.option("--drop-final-state-correction", "drop_final_state", is_flag=True, help=DROP_FINAL_HELP)
@click.option("--copy-base", is_flag=True,
              help="Copy the merged weights into DEST/base-model instead of hard-linking them to OUT_PATH's.")
@click.option("--drop-lora-bias", is_flag=True, help=DROP_BIAS_HELP)
@click.option("--uniform-rank", is_flag=True,
              help="Pad every LoRA of an adapter with zeros to its largest rank (one r, one lora_alpha, no "
                   "rank_pattern): for loaders that read one lora_alpha per file, such as llama.cpp's "
                   "convert_lora_to_gguf.py. The products, and so the logits, are unchanged.")
def export_peft_command(out_path: str, dest: str, domains, drop_position_bias: bool, drop_final_state: bool,
                        copy_base: bool, drop_lora_bias: bool, uniform_rank: bool):
    """Write DEST/<domain>/: one PEFT LoRA adapter per domain (on lm_head for a linear final-state or head
    correction, on the block linears for block adapters), and DEST/base-model/: the plain merge they sit
    on (plain config, own lm_head when tied; weights hard-linked from OUT_PATH).

    \b
    OUT_PATH  a repaired directory (left unchanged) trained with `content: linear`, or any one with
              block adapters or a head correction and content: relu with --drop-final-state-correction
    DEST      a new directory; load with PeftModel.from_pretrained(base, "DEST/<domain>"), where
              base = AutoModelForCausalLM.from_pretrained("DEST/base-model"), or with
              AutoPeftModelForCausalLM.from_pretrained("DEST/<domain>")
    """
    from mergekit_darts.output.check import check_output_dir
    from mergekit_darts.output.peft_export import BASE_DIR, export_peft

    check_output_dir(out_path)
    summaries = export_peft(out_path, dest, list(domains) or None, drop_position_bias=drop_position_bias,
                            copy_base=copy_base, drop_final_state=drop_final_state, drop_lora_bias=drop_lora_bias)
    base = summaries.pop(BASE_DIR)
    files = ", ".join(f"{len(base[key])} {key}" for key in ("linked", "copied", "written") if base[key])
    click.echo(f"{BASE_DIR}: plain {base['architecture']}{' with an untied lm_head' if base['untied_head'] else ''} "
               f"-> {os.path.join(dest, BASE_DIR)} (weight files: {files})")
    for name, summary in summaries.items():
        _echo_dropped(name, summary, summary["block_modules"], summary["rank"] > 0)
        targets = [f"rank {summary['rank']} on lm_head"] if summary["rank"] else []
        targets += [f"rank {summary['shape'].depth_rank} on {summary['block_modules']} block linears"] if summary[
            "block_modules"] else []
        click.echo(f"{name}: LoRA {' + '.join(targets)} -> {os.path.join(dest, name)}")
        if uniform_rank:
            from mergekit_darts.serving.gguf import uniform_rank as pad_to_one_rank

            padded = pad_to_one_rank(os.path.join(dest, name))
            if padded is not None:
                click.echo(f"{name}: every LoRA padded with zeros to rank {padded} (--uniform-rank)")
        elif _has_rank_pattern(os.path.join(dest, name)):  # PEFT reads it; llama.cpp's converter does not
            click.echo(f"{name}: lm_head's LoRA has its own rank (rank_pattern/alpha_pattern), which llama.cpp's "
                       "convert_lora_to_gguf.py does not read (one lora_alpha per file: lm_head's LoRA would be "
                       "scaled by the block rank / its rank); for llama.cpp export with --uniform-rank, or use "
                       "export-gguf")
        if summary.get("lora_bias"):
            click.echo(f"{name}: the adapters carry biases (lora_bias: true): PEFT applies them, but its "
                       "merge_and_unload refuses targets without a base bias; `mergekit-darts bake` folds them")


def _has_rank_pattern(folder: str) -> bool:
    with open(os.path.join(folder, "adapter_config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    return bool(config.get("rank_pattern") or config.get("alpha_pattern"))


@click.command("export-gguf")
@click.argument("out_path", metavar="OUT_PATH")
@click.argument("dest", metavar="DEST")
@click.option("--llama-cpp", "llama_cpp", required=True, metavar="DIR",
              help="llama.cpp's source folder (its convert_hf_to_gguf.py and convert_lora_to_gguf.py are run).")
@click.option("--outtype", type=click.Choice(["f32", "f16", "bf16", "q8_0"]), default="f16", show_default=True,
              help="GGUF tensor type of the base and the LoRAs (f32 reproduces transformers' float32 tokens).")
@click.option("--domain", "domains", multiple=True, help="Export only this domain (repeatable; default: all).")
@click.option("--drop-position-bias", is_flag=True, help=DROP_HELP)
@click.option("--drop-final-state-correction", "drop_final_state", is_flag=True, help=DROP_FINAL_HELP)
@click.option("--drop-lora-bias", is_flag=True, help=DROP_BIAS_HELP)
def export_gguf_command(out_path, dest, llama_cpp, outtype, domains, drop_position_bias, drop_final_state,
                        drop_lora_bias):
    """Write DEST/: base.gguf (the plain merge), lora-<domain>.gguf per domain, an Ollama Modelfile per
    domain and SERVING.md with the llama-server and `mergekit-darts serve` command lines.

    \b
    OUT_PATH  a repaired directory (left unchanged), as for export-peft
    DEST      a new directory
    """
    from mergekit_darts.output.check import check_output_dir
    from mergekit_darts.serving.gguf import export_gguf

    check_output_dir(out_path)
    files, summaries = export_gguf(out_path, dest, llama_cpp, outtype, list(domains) or None,
                                   drop_position_bias=drop_position_bias, drop_final_state=drop_final_state,
                                   drop_lora_bias=drop_lora_bias)
    for name, summary in summaries.items():
        _echo_dropped(name, summary, summary["block_modules"], summary["rank"] > 0)
    for name, what in files.items():
        click.echo(f"{os.path.join(dest, name)}: {what}")
