"""``extract_fit: activations``: the data-free extract's SVD weighted by what each linear actually reads
(docs/quality.md, "Fitting the extract to the activations").

The plain extract keeps the rank-r directions of ``W_E - W_M`` with the largest singular values: the
best rank-r approximation of the weights, whatever the inputs. What the model computes is ``ΔW x`` on
the inputs the linear sees, which are far from isotropic, so the best rank-r *output* correction is the
one that minimizes ``Σ_x |(ΔW - up·down) x|²`` over them. With ``G = Σ x xᵀ / n = S Sᵀ`` (Cholesky,
damped) that error is ``|(ΔW - up·down) S|²_F``: the truncated SVD of ``ΔW S`` gives ``up`` as before
and ``down`` times ``S⁻¹`` (SVD-LLM, Wang et al. 2024; ASVD). The inputs are the merge's own, on the
domain's training records only (never the held-out ones the report measures on); the head correction
is weighted by the merge's final states the same way.
"""

from contextlib import contextmanager
from typing import Dict, Optional, Tuple

import torch

from mergekit_darts.repair.train.delta_init import Factors, Linear, low_rank_factors

# added to the Gram matrix's diagonal, times its mean diagonal: keeps the Cholesky factor invertible
# where an input feature never varies (GPTQ's damping), and bounds how far a rare direction is trusted
GRAM_DAMPING = 0.01


def damped_cholesky(gram: torch.Tensor) -> torch.Tensor:
    """Lower ``S`` with ``S Sᵀ = G + damping·mean(diag G)·I`` (float64 for the factorization)."""
    gram = gram.double()
    diagonal = float(gram.diagonal().mean())
    damp = GRAM_DAMPING * diagonal if diagonal > 0 else 1.0
    eye = torch.eye(gram.shape[0], dtype=gram.dtype)
    return torch.linalg.cholesky(gram + damp * eye)


def weighted_low_rank_factors(delta: torch.Tensor, rank: int, gram: torch.Tensor,
                              device: torch.device = torch.device("cpu"), floor: float = 0.0) -> Factors:
    """``(down, up)`` minimizing the output error ``|(delta - up @ down) S|_F`` (``gram = S Sᵀ``, damped)
    at ``rank``. The rounding ``floor`` of the weights scales with ``S``'s largest singular value, an
    upper bound of what rounding noise becomes in the weighted matrix."""
    factor = damped_cholesky(gram)
    scale = float(torch.linalg.matrix_norm(factor, ord=2))
    down, up = low_rank_factors((delta.double() @ factor).float(), rank, device, floor * scale)
    # down S⁻¹: rows of zeros (empty directions) stay zero
    down = torch.linalg.solve_triangular(factor, down.double(), upper=False, left=False).float()
    return down, up


@contextmanager
def _input_grams(tail, grams: Dict[Linear, torch.Tensor], mask_holder: list):
    """Forward hooks adding ``xᵀx`` of each adapted linear's unmasked inputs to ``grams``. Linears that
    read the same tensor (q/k/v; gate/up) share one product."""
    handles, last = [], [None, None]  # the last input read (held, so its memory is not reused) and its product

    def hook(key):
        def add(module, args):
            x = args[0]
            if last[0] is not x:
                rows = x.reshape(-1, x.shape[-1])[mask_holder[0]].float()
                last[0], last[1] = x, (rows.T @ rows).double().cpu()
            grams[key] += last[1]
        return add

    try:
        for index, paths in tail.targets.items():
            for path, (in_features, *_) in paths.items():
                grams[(index, path)] = torch.zeros(in_features, in_features, dtype=torch.float64)
                linear = tail.layers[index - tail.first].get_submodule(path)
                handles.append(linear.register_forward_pre_hook(hook((index, path))))
        yield
    finally:
        last[0] = last[1] = None
        for handle in handles:
            handle.remove()


@torch.no_grad()
def activation_grams(tail, block_inputs: torch.Tensor, final_states: torch.Tensor, position_ids: torch.Tensor,
                     mask: torch.Tensor, rows: torch.Tensor, batch_size: int, device,
                     head: bool) -> Tuple[Dict[Linear, torch.Tensor], Optional[torch.Tensor], int]:
    """(``{(layer, path): Σ x xᵀ / n}`` of every adapted linear of ``tail`` (None: no block adapters),
    the head's over ``final_states`` when ``head``, n): the merge's own inputs at the unmasked positions
    of ``rows``, run ``batch_size`` rows at a time through the frozen blocks."""
    grams: Dict[Linear, torch.Tensor] = {}
    head_gram = None
    count = 0
    mask_holder = [None]
    if tail is not None:
        with _input_grams(tail, grams, mask_holder):
            for start in range(0, rows.numel(), batch_size):
                index = rows[start:start + batch_size]
                valid = mask[index].reshape(-1).bool().to(device)
                mask_holder[0] = valid
                count_here = int(valid.sum())
                if count_here == 0:
                    continue
                tail.blocks(block_inputs[index].float().to(device), position_ids[index].to(device))
                count += count_here
    if head:
        head_count = 0
        width = final_states.shape[-1]
        head_gram = torch.zeros(width, width, dtype=torch.float64)
        for start in range(0, rows.numel(), batch_size):
            index = rows[start:start + batch_size]
            states = final_states[index].reshape(-1, width)[mask[index].reshape(-1).bool()].float()
            head_gram += (states.T @ states).double()
            head_count += states.shape[0]
        head_gram /= max(head_count, 1)
        count = count or head_count
    grams = {key: gram / max(count, 1) for key, gram in grams.items()}
    return grams, head_gram, count
