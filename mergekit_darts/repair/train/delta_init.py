"""``adapter_init: delta``: block adapters and the head correction started from the expert's weight
deltas (docs/quality.md, "Starting from the weight deltas").

A block adapter on a linear ``y = W_M x`` of the merge adds ``up(down(x))``; the expert computes
``W_E x``. The best rank-r start is the truncated SVD of ``W_E - W_M`` with the square roots of the
singular values on each side: ``down = sqrt(S) V^T``, ``up = U sqrt(S)`` — exactly what
``mergekit-extract-lora --model EXPERT --base-model MERGED --max-rank r`` writes as ``lora_A`` /
``lora_B`` for that linear (``tests/test_delta_init.py`` compares the two). The head correction
``H_u H_d`` starts from the SVD of ``W_E - W_M`` of the LM heads the same way. With ``steps: 0`` this
is the data-free extract every trained repair is compared with (``baseline`` in darts_report.json).

Tensors are read one at a time from the safetensors files (single file or sharded index), never a
whole model: peak memory is one linear of each model and its float32 difference.
"""

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch
from tqdm.auto import tqdm

from mergekit_darts.errors import FormatError
from mergekit_darts.weight_files import SafetensorsWeights

# Up to this smaller side the SVD is exact (LAPACK / cuSOLVER), as mergekit-extract-lora computes it;
# above it on a CPU, randomized (torch.svd_lowrank): an exact SVD of a 4096 x 11008 matrix takes tens
# of seconds per linear on a CPU, 224 of them on a 7B. On a GPU the SVD is always exact.
EXACT_SVD_MAX = 2048
LOWRANK_OVERSAMPLE = 16  # extra columns of the randomized range finder
LOWRANK_ITERATIONS = 6  # its power iterations (the singular values of weight deltas decay slowly)

Factors = Tuple[torch.Tensor, torch.Tensor]  # (down [r, in], up [out, r]), float32, on the cpu


def low_rank_factors(delta: torch.Tensor, rank: int, device: torch.device = torch.device("cpu")) -> Factors:
    """``(down, up)`` with ``up @ down`` the best rank-``rank`` approximation of ``delta`` (zero rows /
    columns past the matrix's own rank)."""
    matrix = delta.to(device, torch.float32)
    out_features, in_features = matrix.shape
    kept = min(rank, out_features, in_features)
    if min(out_features, in_features) <= EXACT_SVD_MAX or matrix.device.type == "cuda":
        u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    else:
        with torch.random.fork_rng(devices=[]):  # the range finder's draws never move the run's seed
            torch.manual_seed(0)
            u, s, v = torch.svd_lowrank(matrix, q=min(kept + LOWRANK_OVERSAMPLE, out_features, in_features),
                                        niter=LOWRANK_ITERATIONS)
        vh = v.T
    root = s[:kept].sqrt()
    down = torch.zeros(rank, in_features)
    up = torch.zeros(out_features, rank)
    down[:kept] = (root[:, None] * vh[:kept]).cpu()
    up[:, :kept] = (u[:, :kept] * root[None]).cpu()
    return down, up


@dataclass
class DomainDeltas:
    """One domain's start: factors per adapted linear ``(layer index, path in the block)``, and the
    head's when the module has a head correction."""

    rank: int
    blocks: Dict[Tuple[int, str], Factors] = field(default_factory=dict)
    head_rank: int = 0
    head: Optional[Factors] = None
    svd: str = "exact"  # "exact" or "randomized" (some linear above EXACT_SVD_MAX on a CPU)

    @property
    def parameters(self) -> int:
        """Parameters of the extract: what it adds to the merge (the final-state correction stays identity)."""
        factors = list(self.blocks.values()) + ([self.head] if self.head is not None else [])
        return sum(down.numel() + up.numel() for down, up in factors)

    def describe(self) -> Dict[str, object]:
        return {"rank": self.rank, "linears": len(self.blocks), "head_rank": self.head_rank if self.head else 0,
                "parameters": self.parameters, "svd": self.svd}


def domain_deltas(merged_dir: str, expert_dir: str, targets, rank: int, head_rank: int,
                  expert_head: Optional[torch.Tensor], merged_head: Optional[torch.Tensor],
                  device: torch.device = torch.device("cpu"), progress: bool = False,
                  desc: str = "weight deltas") -> DomainDeltas:
    """The SVD start of every linear in ``targets`` (``blocks.block_linear_targets``: {layer: {path:
    (in, out)}}) at ``rank``, and of the head at ``head_rank`` (0: none), expert minus merge."""
    merged, expert = SafetensorsWeights(merged_dir), SafetensorsWeights(expert_dir)
    deltas = DomainDeltas(rank=rank, head_rank=head_rank)
    linears = [(index, path, shape) for index, paths in (targets or {}).items() for path, shape in paths.items()]
    for index, path, (in_features, out_features) in tqdm(linears, desc=desc, disable=not progress, leave=False):
        suffix = f"layers.{index}.{path}.weight"
        delta = expert.read(suffix).float() - merged.read(suffix).float()
        if tuple(delta.shape) != (out_features, in_features):
            raise FormatError(f"{expert_dir}: {suffix} has shape {tuple(delta.shape)}, the merge's linear "
                              f"({out_features}, {in_features})")
        if min(delta.shape) > EXACT_SVD_MAX and device.type != "cuda":
            deltas.svd = "randomized"
        deltas.blocks[(index, path)] = low_rank_factors(delta, rank, device)
    if head_rank > 0 and expert_head is not None and merged_head is not None:
        deltas.head = low_rank_factors(expert_head.float() - merged_head.float(), head_rank, device)
    return deltas


@torch.no_grad()
def start_from_deltas(surgery, deltas: DomainDeltas) -> None:
    """Copy the factors into a freshly built ``DomainSurgery`` (its final-state correction stays the identity)."""
    for index, path, adapter in surgery.block_adapters():
        down, up = deltas.blocks[(index, path)]
        adapter.down.weight.copy_(down)
        adapter.up.weight.copy_(up)
    if deltas.head is not None and surgery.head_down is not None:
        surgery.head_down.weight.copy_(deltas.head[0])
        surgery.head_up.weight.copy_(deltas.head[1])
