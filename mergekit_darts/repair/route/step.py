"""The surgery's router step: the captured prompt states as the router reads them (the merged states
where the emitted model routes), ``router_eval``'s capture, and the router's training (docs/routing.md)."""

from typing import Optional

from mergekit_darts.repair.train.split import real_prompt_count, split_held_out


def router_step(out_path: str, captured, surgery, settings, ctx=None):
    """Train the domain router on the captured prompt states (docs/routing.md): prompt prefixes,
    classifier and gate chosen in cross-validation on the training records; measured on the
    surgery's held-out records and on ``router_eval`` (or swapped domains). ``surgery`` and
    ``settings``: the run's SurgeryConfig and RunSettings. Returns (router, entry)."""
    from mergekit_darts.repair.route.train import train_router

    # the greedy rows only: a sampled continuation repeats its prompt, whose pooled state would then
    # sit on both sides of the router's held-out split
    # and the user's prompts only (synthesized ones are the expert's guesses at them)
    reads = surgery.router_states
    states = {name: _router_states(data, reads, real_prompt_count(data)) for name, data in captured.domains.items()}
    splits = {name: split_held_out(s.records, surgery.held_out, settings.seed) for name, s in states.items()}
    eval_states = None
    if surgery.router_eval is not None:
        from mergekit_darts.repair.capture.context import open_run_context

        ctx = ctx or open_run_context(out_path, surgery, settings)
        eval_data = _capture_router_eval(ctx, surgery, settings)
        eval_states = _router_states(eval_data, reads)
    return train_router(states, splits, threshold=surgery.router_threshold, fallback_rate=surgery.router_fallback,
                        kind=surgery.router_kind, seed=settings.seed, eval_states=eval_states, reads=reads)


def _router_states(data, reads: str, rows: Optional[int] = None):
    """The captured prompts as the router sees them (``reads``: "final", the merged model's final states;
    "block_input", the first adapted block's input), over the prompt tokens (``rows``: the first rows only)."""
    from mergekit_darts.repair.route.prefix import PromptStates

    hidden = data.block_inputs if reads == "block_input" else data.merged_hidden
    rows = hidden.shape[0] if rows is None else rows
    return PromptStates(hidden[:rows], data.prompt_lengths[:rows])


def _capture_router_eval(ctx, surgery, settings):
    from mergekit_darts.calibration_text import truncate_for_positions
    from mergekit_darts.repair.capture.calibration import apply_chat_template, load_calibration_texts
    from mergekit_darts.repair.capture.domains import DomainCaptureSpec, capture_merged_prompts

    where = "surgery.router_eval"
    texts = load_calibration_texts(surgery.router_eval, settings.seed, where)
    texts = truncate_for_positions(texts, surgery.max_positions, ctx.tokenizer)[0]  # before tokenizing
    if surgery.router_eval.chat_template:
        texts = apply_chat_template(texts, ctx.tokenizer, where=f"{where}.chat_template")
    spec = DomainCaptureSpec(name="router_eval", expert=ctx.merged_dir, texts=texts,
                             add_special_tokens=not surgery.router_eval.chat_template)
    return capture_merged_prompts(ctx, spec, depth=surgery.depth if surgery.router_states == "block_input" else 0)
