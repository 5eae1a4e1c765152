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

Memory: the blocks run one at a time over the training records (``LayerInputs``), so only one layer's
Gram matrices are held, on the training device with their Cholesky factors (at 7B: 4096² for the
attention, o_proj and gate/up inputs, 11008² for down_proj, float64: about 1.4 GB, twice that with the
factors), beside the records' hidden states at that layer (on the cpu: the size of the cached block input).
"""

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from mergekit_darts.repair.train.delta_init import Factors, Linear, low_rank_factors

# added to the Gram matrix's diagonal, times its mean diagonal: keeps the Cholesky factor invertible
# where an input feature never varies (GPTQ's damping), and bounds how far a rare direction is trusted
GRAM_DAMPING = 0.01
POWER_ITERATIONS = 32  # for the largest eigenvalue of a Gram matrix (only the rounding floor's scale)


@dataclass
class Whitening:
    """``S`` (lower, ``S Sᵀ`` = the damped Gram matrix of a linear's inputs, float64) and its largest
    singular value."""

    factor: torch.Tensor
    scale: float

    def low_rank_factors(self, delta: torch.Tensor, rank: int, device: torch.device = torch.device("cpu"),
                         floor: float = 0.0) -> Factors:
        """``weighted_low_rank_factors`` of ``delta`` on these inputs (what ``domain_deltas`` calls)."""
        return weighted_low_rank_factors(delta, rank, self, device, floor)


def whitening(gram: torch.Tensor) -> Whitening:
    gram = gram.double()  # on its device: a 7B's 11008-wide down_proj input is ~0.4 T FLOP to factor
    diagonal = float(gram.diagonal().mean())
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    damped = gram + (GRAM_DAMPING * diagonal if diagonal > 0 else 1.0) * eye
    vector = torch.ones(gram.shape[0], dtype=gram.dtype, device=gram.device)
    for _ in range(POWER_ITERATIONS):  # a Gram matrix is positive: no sign flips, converges from below
        vector = damped @ vector
        vector /= vector.norm()
    largest = float(vector @ damped @ vector)
    return Whitening(torch.linalg.cholesky(damped), largest ** 0.5)


def weighted_low_rank_factors(delta: torch.Tensor, rank: int, gram, device: torch.device = torch.device("cpu"),
                              floor: float = 0.0) -> Factors:
    """``(down, up)`` minimizing the output error ``|(delta - up @ down) S|_F`` (``gram``: the inputs' Gram
    matrix, or its ``Whitening``) at ``rank``. The rounding ``floor`` of the weights scales with ``S``'s
    largest singular value, an upper bound of what rounding noise becomes in the weighted matrix."""
    white = gram if isinstance(gram, Whitening) else whitening(gram)
    factor = white.factor  # where the Gram matrix was collected: the training device
    weighted = (delta.to(factor.device, torch.float64) @ factor).float()
    down, up = low_rank_factors(weighted, rank, device, floor * white.scale)
    # down S⁻¹: rows of zeros (empty directions) stay zero
    down = torch.linalg.solve_triangular(factor, down.to(factor.device, torch.float64), upper=False, left=False)
    return down.float().cpu(), up


class LayerInputs:
    """Each adapted linear's input ``Whitening`` on the training records, one block at a time: asking for a
    linear of layer ``i`` runs the frozen blocks up to ``i`` over the records' hidden states (unmasked
    positions only, the merge's own inputs), keeping only that layer's Gram matrices. Linears that read
    the same tensor (q/k/v; gate/up) share one. Ask in layer order (``domain_deltas`` does)."""

    def __init__(self, tail, block_inputs: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                 rows: torch.Tensor, batch_size: int, device):
        self.tail, self.batch_size, self.device = tail, batch_size, device
        self.hidden = block_inputs[rows].float()  # a copy: advanced in place, block by block
        self.position_ids = position_ids[rows]
        self.valid = mask[rows].bool()
        self.positions = int(self.valid.sum())
        self.layer: Optional[int] = None
        self.grams: Dict[Linear, torch.Tensor] = {}
        self._white: Dict[int, Whitening] = {}

    def __call__(self, key: Linear) -> Whitening:
        index = key[0]
        if self.layer is not None and index < self.layer:
            raise ValueError(f"LayerInputs: layer {index} asked after layer {self.layer}")
        while self.layer is None or self.layer < index:
            self._advance()
        gram = self.grams[key]
        if id(gram) not in self._white:
            self._white[id(gram)] = whitening(gram)
        return self._white[id(gram)]

    @torch.no_grad()
    def _advance(self) -> None:
        layer = self.tail.first if self.layer is None else self.layer + 1
        block = self.tail.view(layer - self.tail.first, layer - self.tail.first + 1)
        grams: Dict[Linear, torch.Tensor] = {}
        shared: Dict[Linear, Linear] = {}  # a linear that read its sibling's input -> that sibling
        last = [None, None, None]  # the input last read (held: its memory is not reused), its rows' mask, who read it
        handles = []

        def hook(key):
            def add(module, args):
                x = args[0]
                if last[0] is x:  # same tensor as the sibling just before it
                    shared.setdefault(key, last[2])
                    return
                rows = x.reshape(-1, x.shape[-1])[last[1]].float()
                grams[key] = grams.get(key, 0) + (rows.T @ rows).double()  # kept on the device
                last[0], last[2] = x, key
            return add

        try:
            for path in self.tail.targets[layer]:
                linear = self.tail.layers[layer - self.tail.first].get_submodule(path)
                handles.append(linear.register_forward_pre_hook(hook((layer, path))))
            for start in range(0, self.hidden.shape[0], self.batch_size):
                rows = slice(start, start + self.batch_size)
                last[:] = [None, self.valid[rows].reshape(-1).to(self.device), None]
                out = block.blocks(self.hidden[rows].to(self.device), self.position_ids[rows].to(self.device))
                self.hidden[rows] = out.cpu()
        finally:
            last[:] = [None, None, None]
            for handle in handles:
                handle.remove()
        count = max(self.positions, 1)
        self.grams = {key: gram / count for key, gram in grams.items()}
        for key, sibling in shared.items():
            self.grams[key] = self.grams[sibling]
        self._white = {}
        self.layer = layer


def head_whitening(final_states: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> Whitening:
    """The head correction's: the merge's final states at the unmasked positions of ``rows``."""
    width = final_states.shape[-1]
    states = final_states[rows].reshape(-1, width)[mask[rows].reshape(-1).bool()].float()
    return whitening((states.T @ states).double() / max(states.shape[0], 1))
