"""The expert's per-position next-token entropy, in bounded chunks (the EWL1 weight, docs/design.md §3)."""

from typing import Optional

import torch

# Elements of one [chunk, V] float32 buffer in token_entropy (16 MiB): at most two exist at once,
# so the entropy pass stays small next to the model whatever the vocabulary size.
ENTROPY_CHUNK_ELEMENTS = 1 << 22


@torch.no_grad()
def token_entropy(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    lm_head_bias: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """Per-position entropy of softmax(W h [+ b]) in float32: [..., H] -> [...].

    Computed ``chunk_size`` positions at a time (default: as many as fit in ENTROPY_CHUNK_ELEMENTS
    per [chunk, V] buffer); only the entropies are kept, never the logits. In-place ops keep two
    [chunk, V] buffers alive at most.
    """
    if hidden_states.shape[-1] != lm_head_weight.shape[-1]:
        raise ValueError(
            f"hidden_states: hidden size {hidden_states.shape[-1]} does not match lm_head_weight "
            f"{tuple(lm_head_weight.shape)}"
        )
    if chunk_size is None:
        chunk_size = max(1, ENTROPY_CHUNK_ELEMENTS // lm_head_weight.shape[0])
    if chunk_size <= 0:
        raise ValueError(f"chunk_size: must be positive, got {chunk_size}")
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    weight = lm_head_weight.to(flat.device).float()
    bias = None if lm_head_bias is None else lm_head_bias.to(flat.device).float()
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    for start in range(0, flat.shape[0], chunk_size):
        log_p = flat[start:start + chunk_size].float() @ weight.T
        if bias is not None:
            log_p += bias
        log_p -= torch.logsumexp(log_p, dim=-1, keepdim=True)
        # H = -sum p log p, with p = exp(log_p) as the second buffer, multiplied in place
        out[start:start + chunk_size] = -log_p.exp().mul_(log_p).sum(dim=-1)
    return out.reshape(hidden_states.shape[:-1])
