"""``adapter_init: delta``: block adapters and the head correction started from the expert's weight
deltas (docs/quality.md, "Starting from the weight deltas").

A block adapter on a linear ``y = W_M x`` of the merge adds ``up(down(x))``; the expert computes
``W_E x``. The best rank-r start is the truncated SVD of ``W_E - W_M`` with the square roots of the
singular values on each side: ``down = sqrt(S) V^T``, ``up = U sqrt(S)`` — exactly what
``mergekit-extract-lora --model EXPERT --base-model MERGED --max-rank r`` writes as ``lora_A`` /
``lora_B`` for that linear (``tests/test_delta_init.py`` compares the two), and on a linear with a
bias (Qwen2's q/k/v) the adapter's bias ``up.bias`` is ``b_E - b_M``, the tool's ``lora_B.bias``. The head correction
``H_u H_d`` starts from the SVD of ``W_E - W_M`` of the LM heads the same way. With ``steps: 0`` this
is the data-free extract every trained repair is compared with (``baseline`` in darts_report.json).

Tensors are read one at a time from the safetensors files (single file or sharded index), never a
whole model: peak memory is one linear of each model and its float32 difference.
"""

import os
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
Linear = Tuple[int, str]  # (layer index, path of the linear in its block)
# a singular value at most this share of the largest times the matrix's larger side is numerically
# zero in float32 (numpy.linalg.matrix_rank's rule), and one at most what the checkpoints' own rounding
# gives (``rounding_floor``: their stored dtype's): its direction is left empty for a LoRA start (see below)
EMPTY_TOLERANCE = torch.finfo(torch.float32).eps
# what is cached (capture/cache.py) changes when the reading or the SVD does: bump to stop old entries
EXTRACT_VERSION = 2  # 2: the empty-direction threshold follows the checkpoints' dtype


def unit_roundoff(dtype: torch.dtype) -> float:
    """The largest relative rounding error of a value stored in ``dtype``: half its epsilon, 2^-8 for
    bfloat16, 2^-11 for float16, 2^-24 for float32 (0 for a type that stores values exactly)."""
    return torch.finfo(dtype).eps / 2 if dtype.is_floating_point else 0.0


def rounding_floor(expert: torch.Tensor, merged: torch.Tensor) -> float:
    """About the largest singular value that the rounding of the two tensors *as stored* alone gives their
    difference: each entry is off by up to ``unit_roundoff(dtype)`` of its value, so the rounding error is
    a matrix of entries about ``u·|W|``, whose largest singular value is about their RMS × (√out + √in)
    (and at least its largest entry). A direction of expert − merge below it cannot be told from the
    checkpoints' rounding: on bfloat16 checkpoints the directions past a low-rank delta's rank sit there,
    orders of magnitude above float32's rule."""
    out_features, in_features = expert.shape
    bulk = sum((unit_roundoff(t.dtype) * float(torch.linalg.vector_norm(t, dtype=torch.float32))) ** 2
               for t in (expert, merged)) ** 0.5 / (out_features * in_features) ** 0.5
    peak = sum(unit_roundoff(t.dtype) * float(t.abs().max()) for t in (expert, merged) if t.numel())
    return max(bulk * (out_features ** 0.5 + in_features ** 0.5), peak)


def low_rank_factors(delta: torch.Tensor, rank: int, device: torch.device = torch.device("cpu"),
                     floor: float = 0.0) -> Factors:
    """``(down, up)`` with ``up @ down`` the best rank-``rank`` approximation of ``delta``. Directions
    the delta does not have (past the matrix's rank, a numerically zero singular value, or one at most
    ``floor``: the checkpoints' rounding, ``rounding_floor``) are exactly zero rows of ``down`` and
    columns of ``up``: ``start_from_deltas`` starts them as a LoRA does."""
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
    tolerance = float(s.max()) * max(out_features, in_features) * EMPTY_TOLERANCE if s.numel() else 0.0
    tolerance = max(tolerance, floor)
    kept = min(kept, int((s > tolerance).sum()))
    root = s[:kept].sqrt()
    down = torch.zeros(rank, in_features)
    up = torch.zeros(out_features, rank)
    down[:kept] = (root[:, None] * vh[:kept]).cpu()
    up[:, :kept] = (u[:, :kept] * root[None]).cpu()
    return down, up


@dataclass
class DomainDeltas:
    """One domain's start: factors per adapted linear ``(layer index, path in the block)``, and the
    head's when the module has a head correction. ``biases``: the bias deltas (expert − merge) of the
    adapted linears that have a bias (Qwen2's q/k/v), which ``mergekit-extract-lora`` writes as
    ``lora_B.bias``: the start of those adapters' own bias (``up.bias``)."""

    rank: int
    blocks: Dict[Linear, Factors] = field(default_factory=dict)
    head_rank: int = 0
    head: Optional[Factors] = None
    svd: str = "exact"  # "exact" or "randomized" (some linear above EXACT_SVD_MAX on a CPU)
    fit: str = "weights"  # what the SVD approximates: the weights, or the outputs on the merge's inputs
    biases: Dict[Linear, torch.Tensor] = field(default_factory=dict)

    @property
    def parameters(self) -> int:
        """Parameters of the extract: what it adds to the merge (the final-state correction stays identity)."""
        factors = list(self.blocks.values()) + ([self.head] if self.head is not None else [])
        return sum(down.numel() + up.numel() for down, up in factors) + sum(b.numel() for b in self.biases.values())

    def empty_directions(self) -> int:
        """Adapter directions the deltas leave empty (started as a LoRA does: random down, zero up)."""
        factors = list(self.blocks.values()) + ([self.head] if self.head is not None else [])
        return sum(int(empty_rows(down, up).sum()) for down, up in factors)

    def describe(self) -> Dict[str, object]:
        described = {"rank": self.rank, "linears": len(self.blocks), "head_rank": self.head_rank if self.head else 0,
                     "parameters": self.parameters, "svd": self.svd, "fit": self.fit, "empty_directions": self.empty_directions()}
        if self.biases:  # adapted linears with a bias (none on Llama-like models: the key is then absent)
            described["bias_linears"] = len(self.biases)
        return described


def empty_rows(down: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Per direction of a factor pair: True where both its row of ``down`` and column of ``up`` are zero."""
    return (down == 0).all(dim=1) & (up == 0).all(dim=0)


def head_weight(weights: SafetensorsWeights) -> torch.Tensor:
    """The LM head as stored: ``lm_head.weight``, or the input embedding of a model that ties them."""
    return weights.read("lm_head.weight" if weights.names_ending("lm_head.weight") else "embed_tokens.weight")


def domain_deltas(merged_dir: str, expert_dir: str, targets, rank: int, head_rank: int,
                  device: torch.device = torch.device("cpu"), progress: bool = False,
                  desc: str = "weight deltas", grams=None) -> DomainDeltas:
    """The SVD start of every linear in ``targets`` (``blocks.block_linear_targets``: {layer: {path:
    (in, out)}}) at ``rank``, and of the head at ``head_rank`` (0: none), expert minus merge, every
    tensor read from the files and subtracted in float32 (the LM heads too: not the capture's cast).
    ``grams``: ``(blocks, head)``, ``activation_fit.LayerInputs`` and ``head_whitening`` (or None): each SVD then
    fits the outputs on those inputs (``extract_fit: activations``) instead of the weights."""
    merged, expert = SafetensorsWeights(merged_dir), SafetensorsWeights(expert_dir)
    deltas = DomainDeltas(rank=rank, head_rank=head_rank, fit="weights" if grams is None else "activations")
    block_grams, head_gram = grams if grams is not None else (None, None)

    def factors(delta, rank_here, floor, gram):
        if gram is None:
            return low_rank_factors(delta, rank_here, device, floor)
        return gram.low_rank_factors(delta, rank_here, device, floor)  # an activation_fit.Whitening

    linears = [(index, path, shape) for index, paths in (targets or {}).items() for path, shape in paths.items()]
    for index, path, (in_features, out_features, *_) in tqdm(linears, desc=desc, disable=not progress, leave=False):
        suffix = f"layers.{index}.{path}.weight"
        expert_weight, merged_weight = expert.read(suffix), merged.read(suffix)
        if tuple(expert_weight.shape) != (out_features, in_features):
            raise FormatError(f"{expert_dir}: {suffix} has shape {tuple(expert_weight.shape)}, the merge's linear "
                              f"({out_features}, {in_features})")
        floor = rounding_floor(expert_weight, merged_weight)  # from the dtypes the two are stored in
        delta = expert_weight.float() - merged_weight.float()
        del expert_weight, merged_weight
        if min(delta.shape) > EXACT_SVD_MAX and device.type != "cuda":
            deltas.svd = "randomized"
        deltas.blocks[(index, path)] = factors(delta, rank, floor, block_grams((index, path)) if grams is not None else None)
        bias = f"layers.{index}.{path}.bias"
        if merged.names_ending(bias):
            deltas.biases[(index, path)] = expert.read(bias).float() - merged.read(bias).float()
    if head_rank > 0:
        expert_head, merged_head = head_weight(expert), head_weight(merged)
        if expert_head.shape != merged_head.shape:
            raise FormatError(f"{expert_dir}: its LM head is {tuple(expert_head.shape)}, the merge's "
                              f"{tuple(merged_head.shape)}")
        floor = rounding_floor(expert_head, merged_head)
        deltas.head = factors(expert_head.float() - merged_head.float(), head_rank, floor, head_gram)
    return deltas


def _entry_shapes(targets, rank: int, head_rank: int, head_shape, biased) -> Dict[str, tuple]:
    shapes = {}
    for index, paths in (targets or {}).items():
        for path, (in_features, out_features, *_) in paths.items():
            shapes[f"blocks.{index}.{path}.down"] = ((rank, in_features), torch.float32)
            shapes[f"blocks.{index}.{path}.up"] = ((out_features, rank), torch.float32)
            if (index, path) in biased:
                shapes[f"blocks.{index}.{path}.bias"] = ((out_features,), torch.float32)
    if head_rank > 0:
        shapes["head.down"] = ((head_rank, head_shape[1]), torch.float32)
        shapes["head.up"] = ((head_shape[0], head_rank), torch.float32)
    return shapes


def cached_domain_deltas(cache_dir: Optional[str], merged_dir: str, expert_dir: str, targets, rank: int,
                         head_rank: int, device: torch.device = torch.device("cpu"), progress: bool = False,
                         desc: str = "weight deltas") -> DomainDeltas:
    """``domain_deltas`` through the capture cache (capture/cache.py), keyed by both models' contents
    (their file hashes are memoized, so a re-run on an unchanged merge reads no expert tensor; the checks
    before the run still read each expert's safetensors headers, preflight_weights.py),
    the adapted linears, the ranks and where the SVD runs (exact on a GPU, maybe randomized on a CPU)."""
    from mergekit_darts.repair.capture.cache import CaptureCache, cache_key, model_identity

    cache = CaptureCache(cache_dir)
    identity = {"merged": model_identity(merged_dir, cache.hashes), "expert": model_identity(expert_dir, cache.hashes)}
    # (in, out) only: whether a linear has a bias is read from the merge's files below, as before
    plain_targets = {str(index): {path: list(shape[:2]) for path, shape in paths.items()}
                     for index, paths in (targets or {}).items()}
    key = cache_key("extract", identity, torch.float32, targets=plain_targets, rank=rank, head_rank=head_rank,
                    svd=[device.type == "cuda", EXACT_SVD_MAX, LOWRANK_OVERSAMPLE, LOWRANK_ITERATIONS],
                    extract_version=EXTRACT_VERSION)
    merged = SafetensorsWeights(merged_dir)  # the merge's headers only: which linears have a bias, the head's shape
    biased = {(index, path) for index, paths in (targets or {}).items() for path in paths
              if merged.names_ending(f"layers.{index}.{path}.bias")}
    head_shape = None
    if head_rank > 0:
        from mergekit_darts.weight_files import safetensors_header

        name = merged.name_ending("lm_head.weight" if merged.names_ending("lm_head.weight") else "embed_tokens.weight")
        head_shape = safetensors_header(merged.files[name])[name]["shape"]
    label = f"extract.{os.path.basename(os.path.normpath(expert_dir))}"
    entry = cache.load(label, key, _entry_shapes(targets, rank, head_rank, head_shape, biased))
    if entry is not None:
        deltas = DomainDeltas(rank=rank, head_rank=head_rank)
        for index, paths in (targets or {}).items():
            for path, (in_features, out_features, *_) in paths.items():
                prefix = f"blocks.{index}.{path}"
                deltas.blocks[(index, path)] = (entry[prefix + ".down"], entry[prefix + ".up"])
                if (index, path) in biased:
                    deltas.biases[(index, path)] = entry[prefix + ".bias"]
                if min(in_features, out_features) > EXACT_SVD_MAX and device.type != "cuda":
                    deltas.svd = "randomized"
        if head_rank > 0:
            deltas.head = (entry["head.down"], entry["head.up"])
        return deltas
    deltas = domain_deltas(merged_dir, expert_dir, targets, rank, head_rank, device, progress, desc)
    tensors = {}
    for (index, path), (down, up) in deltas.blocks.items():
        tensors[f"blocks.{index}.{path}.down"], tensors[f"blocks.{index}.{path}.up"] = down, up
    for (index, path), bias in deltas.biases.items():
        tensors[f"blocks.{index}.{path}.bias"] = bias
    if deltas.head is not None:
        tensors["head.down"], tensors["head.up"] = deltas.head
    cache.save(label, key, tensors)
    return deltas


def extract_start(name: str, surgery, settings, tail, merged_dir: Optional[str],
                  device: torch.device, grams=None) -> Tuple[Optional[DomainDeltas], str]:
    """The domain's truncated-SVD factors of (expert − merge) and, when there are none, why not (the
    report's ``baseline: {"not_measured": why}``). ``adapter_init: delta`` needs them: a failure to
    read them is the run's error. Otherwise they only measure the baseline: a failure (an expert
    whose tensors are named or shaped unlike the merge's) leaves it unmeasured and never fails the run.
    ``grams`` (``extract_fit: activations``): fitted to the outputs on those inputs, never cached (they
    depend on the records)."""
    from mergekit_darts.config import SurgeryConfigError
    from mergekit_darts.repair.capture.models import resolve_model_dir

    if tail is None and surgery.head_rank == 0:
        return None, ("the data-free extract (expert − merge) needs block adapters (depth > 0) or a head "
                      "correction (head_rank > 0)")
    if merged_dir is None:
        if surgery.adapter_init == "delta":
            raise SurgeryConfigError("adapter_init: delta needs the merged model's weights (train_domain's merged_dir)")
        return None, "the merged model's weights were not given"
    try:
        arguments = (merged_dir, resolve_model_dir(surgery.domains[name].model),
                     tail.targets if tail is not None else None, surgery.depth_rank if tail is not None else 0,
                     surgery.head_rank)
        options = {"device": device, "progress": settings.progress, "desc": f"weight deltas[{name}]"}
        if grams is None:
            deltas = cached_domain_deltas(surgery.cache_dir, *arguments, **options)
        else:
            deltas = domain_deltas(*arguments, **options, grams=grams)
    except (FormatError, OSError, ValueError, RuntimeError) as error:
        if surgery.adapter_init == "delta":
            raise
        return None, f"the expert's weight deltas could not be read ({error})"
    return deltas, ""


@torch.no_grad()
def start_from_deltas(surgery, deltas: DomainDeltas) -> None:
    """Copy the factors into a freshly built ``DomainSurgery`` (its final-state correction stays the
    identity). A direction the deltas leave empty keeps the module's own start, a LoRA's (random
    ``down``, zero ``up``): the product is still the extract, and the direction trains — from two
    zero factors no gradient would ever move it (a linear the expert did not change, or the
    directions past a low-rank delta's rank). An adapter with a bias starts it at the bias delta."""
    pairs = [(adapter.down.weight, adapter.up.weight, deltas.blocks[(index, path)])
             for index, path, adapter in surgery.block_adapters()]
    for index, path, adapter in surgery.block_adapters():
        bias = deltas.biases.get((index, path))
        if bias is None:
            continue
        if adapter.up.bias is None:  # the merge's files have a bias the model's linear lacks
            raise ValueError(f"adapter_init: delta: layers.{index}.{path} has a bias in the merge's weight files "
                             "but not in the model; the files and the model's config disagree")
        adapter.up.bias.copy_(bias)
    if deltas.head is not None and surgery.head_down is not None:
        pairs.append((surgery.head_down.weight, surgery.head_up.weight, deltas.head))
    for down, up, (start_down, start_up) in pairs:
        filled = ~empty_rows(start_down, start_up)
        down[filled] = start_down[filled].to(down.dtype)
        up.copy_(start_up)
