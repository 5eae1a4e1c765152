"""Pre-merge checks on how many calibration prompts and positions each domain has (run by ``preflight``):
enough validation prompts for lr choice and early stopping, ``synthesize`` bounded by what it would cost,
room for a prompt beside ``continue_tokens`` under max_positions, and ``train_blocks`` within the adapted blocks."""

from typing import Dict, Tuple

from mergekit_darts.config import SurgeryConfig, SurgeryConfigError
from mergekit_darts.presets import filled_by_preset


def split_sizes(prompts: int, share: float):
    held = int(round(share * prompts)) if share > 0 and prompts >= 2 else 0
    held = min(held, prompts - 1)
    return prompts - held, held


def check_selection_prompts(surgery: SurgeryConfig, prompts: Dict[str, int]) -> None:
    """``lr_candidates`` / ``early_stopping`` choose on validation prompts split off the training ones
    (repair.train.split.split_rows): each domain needs at least one, or training would fail after the merge."""
    candidates = len(surgery.lr_candidates or ()) > 1
    # a preset's own early stopping is turned off for such a run instead (presets.fit_preset, said in the report)
    stopping = surgery.early_stopping and not filled_by_preset(surgery, "early_stopping")
    if not (stopping or candidates):
        return
    key = "early_stopping" if stopping else "lr_candidates"
    for name, count in prompts.items():
        train, _ = split_sizes(count, surgery.held_out)
        # synthesized prompts only ever train: counted as if all N survive their filters (at most that many)
        train += surgery.domains[name].calibration.synthesize
        _, validation = split_sizes(train, surgery.validation)
        if validation == 0:
            raise SurgeryConfigError(
                f"surgery.{key}: domain {name} has {count} usable calibration prompt(s), {train} for training after "
                f"held_out={surgery.held_out:g}, and validation={surgery.validation:g} of them is no prompt to "
                f"choose on; give more samples, raise surgery.validation, or remove {key}")


# calibration.synthesize is bounded by what it costs: up to MAX_SAMPLES (20) expert samples per requested
# prompt, each kept one answered and captured like a user's. 100 per training prompt is 9x what the
# documented runs use (450 from 40); 100 000 in all keeps the sampling's lists and the capture in memory.
SYNTHESIZE_PER_PROMPT = 100
MAX_SYNTHESIZE = 100_000


def check_synthesis_cost(surgery: SurgeryConfig, prompts: Dict[str, int]) -> None:
    """``synthesize: 10000000`` on 8 prompts grew to 4.9 GB with no output: refused before the merge."""
    from mergekit_darts.repair.capture.synthesize import MAX_SAMPLES

    for name, count in prompts.items():
        requested = surgery.domains[name].calibration.synthesize
        train, _ = split_sizes(count, surgery.held_out)
        limit = min(MAX_SYNTHESIZE, SYNTHESIZE_PER_PROMPT * train)
        if requested > limit:
            raise SurgeryConfigError(
                f"surgery.domains.{name}.calibration.synthesize: {requested} prompts from {train} training prompt(s) "
                f"would take up to {MAX_SAMPLES * requested} expert samples; at most {SYNTHESIZE_PER_PROMPT} per "
                f"training prompt and {MAX_SYNTHESIZE} in all ({limit} here): lower it or give more calibration prompts")


def resolved_max_positions(surgery: SurgeryConfig, reference) -> Tuple[int, str]:
    """The max_positions the run will use (``pipeline.resolve_from_model``: an unwritten one becomes the
    merged model's context when that is shorter) and where it comes from, in words."""
    config = reference.get_text_config() if hasattr(reference, "get_text_config") else reference
    context = getattr(config, "max_position_embeddings", None)
    if "max_positions" not in surgery.model_fields_set and isinstance(context, int) and \
            0 < context < surgery.max_positions:
        return context, " (not written: the merged model's max_position_embeddings)"
    return surgery.max_positions, ""


def check_continuation_room(surgery: SurgeryConfig, max_positions: int, source: str = "") -> None:
    """A prompt keeps at least one token, so at most ``max_positions - 1`` tokens continue it: a larger
    ``continue_tokens`` was cut to the room each record left without a word, and the report's budget
    still showed the written value."""
    for name, domain in surgery.domains.items():
        tokens = domain.calibration.continue_tokens
        if tokens >= max_positions:
            raise SurgeryConfigError(
                f"surgery.domains.{name}.calibration.continue_tokens: {tokens} leaves no room for a prompt under "
                f"max_positions {max_positions}{source} (prompt and continuation share those positions: at most "
                f"{max_positions - 1} continue a one-token prompt); lower continue_tokens or raise max_positions")


def check_train_blocks(surgery: SurgeryConfig, layers, reference_name: str) -> None:
    """``train_blocks`` at most the adapted blocks: with ``depth: all`` the model's layers (a written
    ``depth`` is compared by the schema itself)."""
    k = surgery.train_blocks
    if surgery.depth == "all" and isinstance(layers, int) and isinstance(k, int) and k > layers:
        raise SurgeryConfigError(f"surgery.train_blocks: {k} exceeds the {layers} adapted decoder blocks "
                                 f"(depth: all, {reference_name}); use at most {layers} (or all)")
