"""The expert's per-position next-token entropy, in bounded chunks (the EWL1 weight, docs/design.md §3).

The logits are float32 whatever the model's dtype. A float32 copy of a [V, H] head is ~2 GB at a
128k vocabulary, so ``entropy_head`` prepares the head once per capture pass: kept in its own dtype
where the device multiplies low-precision inputs into float32 outputs (CUDA: bfloat16/float16 inputs
are exact, products and sums float32), else converted to float32 once, never per batch.
"""

import functools
from typing import Optional

import torch

# Elements of one [chunk, V] float32 buffer in token_entropy (16 MiB): at most two exist at once,
# so the entropy pass stays small next to the model whatever the vocabulary size.
ENTROPY_CHUNK_ELEMENTS = 1 << 22


@functools.lru_cache(maxsize=None)
def _float32_output_matmul(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` runs for ``dtype`` inputs on this device type."""
    if device_type != "cuda":
        return False
    try:
        a = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)).to(device_type, dtype)
        out = torch.mm(a, a.T, out_dtype=torch.float32)
        exact = a.double() @ a.double().T  # the products of low-precision inputs, summed exactly
        return out.dtype == torch.float32 and bool(torch.allclose(out.double(), exact, rtol=1e-5, atol=1e-4))
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def entropy_head(weight: torch.Tensor, device) -> torch.Tensor:
    """The LM head as ``token_entropy`` should get it on ``device``, made once per pass."""
    weight = weight.to(device)
    if weight.dtype == torch.float32 or _float32_output_matmul(weight.device.type, weight.dtype):
        return weight
    return weight.float()


def _float32_logits(states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if weight.dtype == torch.float32:
        return states.float() @ weight.T
    if _float32_output_matmul(weight.device.type, weight.dtype):
        return torch.mm(states.to(weight.dtype), weight.T, out_dtype=torch.float32)
    return states.float() @ weight.float().T  # a head not prepared by entropy_head


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
    [chunk, V] buffers alive at most. Give the head through ``entropy_head`` when calling repeatedly.
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
    weight = lm_head_weight.to(flat.device)
    bias = None if lm_head_bias is None else lm_head_bias.to(flat.device).float()
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    for start in range(0, flat.shape[0], chunk_size):
        log_p = _float32_logits(flat[start:start + chunk_size], weight)
        if bias is not None:
            log_p += bias
        log_p -= torch.logsumexp(log_p, dim=-1, keepdim=True)
        # H = -sum p log p, with p = exp(log_p) as the second buffer, multiplied in place
        out[start:start + chunk_size] = -log_p.exp().mul_(log_p).sum(dim=-1)
    return out.reshape(hidden_states.shape[:-1])
