"""What ``generate`` carries between the emitted model's forwards for ``darts_domain="auto"`` rows
(docs/design.md §5, docs/routing.md).

Imports torch only; copied into every output directory. The routing sums
(``routing.prompt_state_sums``: [B, H + 1]) that the prefill adds the prompt's states to start at zero,
or, when the caller's cache already holds a prefix, at the sums an ``"auto"`` forward stored on it.
"""

from typing import Optional

import torch

ROUTE_ATTR = "_darts_route_sums"  # on a KV cache object: the routing sums of its sequences' prompts


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


def route_step_inputs(inputs: dict, attention_mask: Optional[torch.Tensor], is_first_iteration: bool) -> None:
    """Complete one step's forward inputs of a generation with "auto" rows: a prefill call (each chunk of a
    chunked prefill) routes and adds its prompt tokens to the sums; a decoding step gets the rows the
    prefill routed as its rows, and nothing to route or write."""
    if is_first_iteration:
        inputs["darts_route"] = "prefill"
        current = inputs["input_ids"] if inputs.get("input_ids") is not None else inputs["inputs_embeds"]
        # the 2-D mask, before the parent made a 4-D one of it for a static cache
        if attention_mask is not None and attention_mask.dim() == 2:
            inputs["darts_prompt_mask"] = attention_mask[:, -current.shape[1]:]
    else:
        inputs["darts_rows"] = inputs.pop("darts_routed_rows")
        inputs.pop("darts_route_state")
