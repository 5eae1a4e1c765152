"""What the emitted model derives as ``generate`` does, and what ``generate`` carries between its forwards
for ``darts_domain="auto"`` rows (docs/design.md §5, docs/routing.md).

Imports torch and the shipped hooks.py/routing.py only; copied into every output directory. The routing sums
(``routing.prompt_state_sums``: [B, H + 1]) that the prefill adds the prompt's states to start at zero,
or, when the caller's cache already holds a prefix, at the sums an ``"auto"`` forward stored on it; the
prompt is what the prefill routes on, never the draft tokens of assisted or prompt-lookup decoding.
"""

import threading
from typing import Optional

import torch

from .hooks import NONE_INDEX, PendingRoute, set_active_call
from .routing import route_rows

ROUTE_ATTR = "_darts_route_sums"  # on a KV cache object: the routing sums of its sequences' prompts


def default_position_ids(seq_len, attention_mask=None, cache=None, device=None) -> torch.Tensor:
    """Position ids of the current tokens when the caller gave none, as ``generate`` derives them:
    from a 2-D attention mask (cumsum - 1, so left padding is skipped; padding gets 0), else
    ``arange`` after the cached length (a tensor for static caches: no host sync). The last
    ``seq_len`` columns are the current tokens."""
    if attention_mask is not None and attention_mask.dim() == 2:
        positions = attention_mask.long().cumsum(-1) - 1
        positions = positions.masked_fill(attention_mask == 0, 0)
        return positions[:, -seq_len:]
    past = cache.get_seq_length() if cache is not None else 0
    return (torch.arange(seq_len, device=device) + past).unsqueeze(0)


def prefill_route_state(cache, batch: int, hidden_size: int, device) -> torch.Tensor:
    """The routing sums generate's prefill starts from. A cache that already holds tokens (prefix caching,
    a conversation's earlier turns) must carry their sums: the router reads the whole prompt's states,
    which a KV cache does not keep, and routing the new tokens alone would silently pick another domain."""
    past = 0 if cache is None else int(cache.get_seq_length())  # once per generate call: a host sync is fine
    if past == 0:
        return torch.zeros(batch, hidden_size + 1, dtype=torch.float32, device=device)
    carried = getattr(cache, ROUTE_ATTR, None)
    if carried is None or carried.shape[0] != batch:
        raise ValueError(
            f"darts_domain='auto': the cache passed to generate already holds {past} tokens, but not the routing of "
            f"{'them' if carried is None else f'{batch} rows (it has {carried.shape[0]})'}: the router reads the whole "
            "prompt's states, which a KV cache does not keep. Fill the cache with an 'auto' forward "
            "(model(prefix_ids, use_cache=True, darts_domain='auto').cache), or name the domain "
            "(model.route_domains(full_prompt_ids) gives the router's pick)")
    return carried.to(device=device, dtype=torch.float32).clone()  # generate adds to it: the cache's stays


def route_step_inputs(inputs: dict, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                      is_first_iteration: bool, prompt_length: Optional[int]) -> None:
    """Complete one step's forward inputs of a generation with "auto" rows: a prefill call (each chunk of a
    chunked prefill) routes and adds its prompt tokens to the sums; a decoding step gets the rows the
    prefill routed as its rows, and nothing to route or write.

    The prompt is the first ``prompt_length`` columns of the sequence: assisted and prompt-lookup
    decoding feed the prompt together with their first draft tokens, which must not be routed on."""
    if not is_first_iteration:
        inputs["darts_rows"] = inputs.pop("darts_routed_rows")
        inputs.pop("darts_route_state")
        return
    inputs["darts_route"] = "prefill"
    current = (inputs["input_ids"] if inputs.get("input_ids") is not None else inputs["inputs_embeds"]).shape[1]
    # the 2-D mask, before the parent made a 4-D one of it for a static cache
    mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
    if mask is None and attention_mask is None and prompt_length is not None and input_ids.shape[1] > prompt_length:
        mask = torch.ones_like(input_ids)  # no mask given: every token is real, the drafts are not prompt
    if mask is None:
        return
    if prompt_length is not None and mask.shape[1] > prompt_length:
        mask = torch.cat([mask[:, :prompt_length], torch.zeros_like(mask[:, prompt_length:])], dim=1)
    inputs["darts_prompt_mask"] = mask[:, -current:]


def routing_mask(prompt_mask, attention_mask, length):
    """[B, length]: which current tokens are real prompt tokens (None: all of them)."""
    mask = prompt_mask if prompt_mask is not None else attention_mask
    if mask is None:
        return None
    if mask.dim() != 2:
        raise ValueError(
            f"darts_domain='auto': the router averages the prompt's real tokens, but attention_mask has shape "
            f"{tuple(mask.shape)}; pass darts_prompt_mask=[batch, tokens] (1 at real tokens) with a "
            "custom mask (generate does this itself from its 2-D mask)")
    return mask[:, -length:]


def router_domain_indices(model) -> tuple:
    """Router index -> index in ``model.darts_domains``."""
    return tuple(model.darts_domains.index(name) for name in model.darts.router.domains)


def pending_route(model, attention_mask, prompt_mask, step, state, routed, cache, batch, length) -> PendingRoute:
    """The routing of a forward's "auto" rows: a call routes on its own tokens unless it continues a
    sequence whose prompt was seen already (a manual loop's call with a non-empty cache that carries
    the routing sums), which takes those sums; generate's prefill calls add to its carried sums."""
    router = model.darts.router
    to_domain = router_domain_indices(model)
    mask = routing_mask(prompt_mask, attention_mask, length)
    if step == "prefill":  # generate: every prefill chunk adds its tokens to the carried sums
        return PendingRoute(router, to_domain, mask=mask, state=state, accumulate=True, routed=routed)
    carried = getattr(cache, ROUTE_ATTR, None) if cache is not None else None
    if carried is None or carried.shape[0] != batch:
        return PendingRoute(router, to_domain, mask=mask)
    past = cache.get_seq_length()
    if isinstance(past, torch.Tensor):  # a static cache: whether it is empty is known on the device only
        return PendingRoute(router, to_domain, mask=mask, state=carried, fresh=past == 0)
    if past == 0:  # an emptied cache (reset) starts a new sequence
        return PendingRoute(router, to_domain, mask=mask)
    return PendingRoute(router, to_domain, state=carried, pool=False)


def routes_on_plain_pass(model) -> bool:
    """A router that reads the final states of a model whose blocks are corrected: its corrected forward
    never computes them, so "auto" rows are routed on a separate uncorrected pass over the prompt."""
    router = model.darts.router
    return router is not None and router.states == "final" and model.darts.first_adapted_layer is not None


def plain_final_states(model, input_ids, inputs_embeds, attention_mask, position_ids, length) -> torch.Tensor:
    """The plain merged model's final-norm output [B, length, H] over the current tokens, without the
    cache: the states a ``states: "final"`` router reads. A mask over cached tokens too is cut to the
    current ones (a call continuing a cache without routing sums routes on its own tokens)."""
    if attention_mask is not None:
        attention_mask = attention_mask[..., -length:]
    previous = set_active_call(None)  # no call active: every correction is off
    try:
        with torch.no_grad():
            return model.model(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                               position_ids=position_ids, use_cache=False).last_hidden_state
    finally:
        set_active_call(previous)


def generation_attention_mask(model, inputs: Optional[torch.Tensor], generate_kwargs: dict) -> Optional[torch.Tensor]:
    """The 2-D attention mask ``generate`` runs with: the caller's, else the one transformers derives from
    the generation config's pad token (``pad_token_id`` of the call or of ``generation_config``; none when
    pad is a stop id or absent: every token is real), computed by transformers' own code so that routing
    up front counts exactly the tokens the prefill attends to. ``inputs``: generate's ids or embeddings."""
    given = generate_kwargs.get("attention_mask")
    if given is not None or inputs is None:
        return given
    settings = {key: value for key, value in generate_kwargs.items()
                if not key.startswith("darts_") and key not in ("inputs", "input_ids", "inputs_embeds")}
    try:
        config, model_kwargs = model._prepare_generation_config(settings.pop("generation_config", None), **settings)
        model._prepare_special_tokens(config, True, device=inputs.device)  # True: generate itself warns, once
        return model._prepare_attention_mask_for_generation(inputs, config, model_kwargs)
    except (AttributeError, TypeError):  # private helpers another transformers version renamed or changed
        return _derived_attention_mask(model, inputs, settings)


def _derived_attention_mask(model, inputs: torch.Tensor, settings: dict) -> Optional[torch.Tensor]:
    """transformers' rule, for versions whose private helpers differ: ids that equal the pad token are
    padding unless pad is also a stop id (then nothing can tell padding from a real end of text);
    embeddings or no pad token: every token is real (None)."""
    config = settings.get("generation_config") or model.generation_config
    pad = settings.get("pad_token_id", getattr(config, "pad_token_id", None))
    eos = settings.get("eos_token_id", getattr(config, "eos_token_id", None))
    stops = set(eos) if isinstance(eos, (list, tuple)) else ({eos} if eos is not None else set())
    if pad is None or pad in stops or inputs.dim() != 2 or inputs.is_floating_point():
        return None
    return (inputs != pad).long()


def route_prompt(model, input_ids=None, inputs_embeds=None, attention_mask=None) -> torch.Tensor:
    """Each row's domain index (NONE_INDEX below the router's gate) for whole prompts [B, T], read from
    the uncorrected states the router was trained on, as an "auto" forward over them routes."""
    tokens = input_ids if input_ids is not None else inputs_embeds
    length = tokens.shape[1]
    mask = routing_mask(None, attention_mask, length)
    positions = default_position_ids(length, attention_mask, None, tokens.device)
    seen = {}
    handle = None
    if model.darts.first_adapted_layer is not None and not routes_on_plain_pass(model):
        first = model.model.layers[model.darts.first_adapted_layer]  # a block_input router reads its input
        handle = first.register_forward_pre_hook(
            lambda module, args, kwargs: seen.update(hidden=args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True)
    try:
        hidden = plain_final_states(model, input_ids, inputs_embeds, attention_mask, positions, length)
    finally:
        if handle is not None:
            handle.remove()
    picked = route_rows(model.darts.router, seen.get("hidden", hidden), mask)
    # the router's -1 ("none") picks the last entry
    return torch.tensor([*router_domain_indices(model), NONE_INDEX], device=picked.device)[picked]


# --- routing sums kept on a caller's cache (a hand-written loop) --------------------------------------

_ROUTED_CACHE_CLASSES: dict = {}
_CLASS_LOCK = threading.Lock()


def _routed_cache_class(base: type) -> type:
    """A subclass of the cache class ``base`` (same ``__name__``) whose row operations (beam search's
    ``reorder_cache``, ``batch_select_indices``, ``batch_repeat_interleave``) apply to the routing sums
    too, so each row keeps its own prompt's routing when a loop reorders the cache."""
    with _CLASS_LOCK:
        if base in _ROUTED_CACHE_CLASSES:
            return _ROUTED_CACHE_CLASSES[base]

        def with_rows(operation, rows_of):
            def method(self, argument):
                result = getattr(base, operation)(self, argument)
                sums = getattr(self, ROUTE_ATTR, None)
                if sums is not None:
                    setattr(self, ROUTE_ATTR, rows_of(sums, argument))
                return result
            return method

        routed = type(base.__name__, (base,), {
            "reorder_cache": with_rows("reorder_cache", lambda sums, rows: sums.index_select(0, rows.to(sums.device))),
            "batch_select_indices": with_rows("batch_select_indices", lambda sums, rows: sums[rows.to(sums.device)]),
            "batch_repeat_interleave": with_rows("batch_repeat_interleave",
                                                 lambda sums, repeats: sums.repeat_interleave(repeats, dim=0)),
            "_darts_routed": True, "__module__": __name__, "__qualname__": f"_DartsRouted{base.__qualname__}"})
        _ROUTED_CACHE_CLASSES[base] = routed
        return routed


def store_route_sums(cache, sums: torch.Tensor) -> None:
    """Keep ``sums`` [B, H + 1] on ``cache`` for the later calls of a hand-written loop. Outside a compiled
    region the cache's class becomes ``_routed_cache_class`` of it, so reordering its rows reorders them."""
    if not getattr(type(cache), "_darts_routed", False) and not torch.compiler.is_compiling():
        cache.__class__ = _routed_cache_class(type(cache))
    setattr(cache, ROUTE_ATTR, sums)
