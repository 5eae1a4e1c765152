"""What a run will cost before it starts (``mergekit-darts plan``): memory and minutes per stage and per
domain, from the YAML and the models' ``config.json`` files only, for a named card or the CPU.

An ESTIMATE by a FLOP-and-bytes model (docs/scale.md "Before the run: plan"): every record is counted at
``max_positions`` tokens (an upper bound: most calibration prompts are shorter; ``--tokens`` sets the
length), training runs all of ``steps`` (early stopping can only stop sooner; the refit after it is
counted), and each stage runs at a fixed share of the card's peak. The memory model counts the tensors the
code holds (``repair/capture``, ``repair/train``); the time model is the one docs/scale.md's 7B figures
use. ``benchmarks/speed_memory/plan_check.py`` compares both with what tiny models measure on this CPU.
"""

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

GB = 1e9


@dataclass(frozen=True)
class Card:
    """A device: its memory, bfloat16 matmul peak (dense), float32 peak, memory bandwidth and float64 peak
    (without tensor cores)."""
    name: str
    memory_gb: float
    bf16_flops: float
    fp32_flops: float
    bandwidth: float  # bytes / s
    fp64_flops: float


# Dense peaks from the vendors' sheets (no sparsity). The CPU row is this project's 2-core CI machine as
# measured (benchmarks/results/bench_capture_sharded.json: 11-14 GFLOP/s through a 141M Llama).
CARDS: Dict[str, Card] = {
    "rtx4090": Card("RTX 4090 (24 GB)", 24, 165e12, 82e12, 1.0e12, 1.3e12),
    "l40s": Card("L40S (48 GB)", 48, 362e12, 91e12, 0.86e12, 1.4e12),
    "a100": Card("A100 80GB", 80, 312e12, 19.5e12, 2.0e12, 9.7e12),
    "h100": Card("H100 SXM (80 GB)", 80, 989e12, 67e12, 3.35e12, 34e12),
    "h200": Card("H200 (141 GB)", 141, 790e12, 67e12, 4.8e12, 34e12),
    "cpu": Card("CPU (2 cores, 24 GB)", 24, 12e9, 12e9, 10e9, 6e9),
}
# shares of peak the stages reach (docs/scale.md's 7B estimates: 40 % of bf16 for blocks, the float32 KL
# at the float32 peak, decoding at 60 % of the bandwidth)
MATMUL_EFFICIENCY, BANDWIDTH_EFFICIENCY = 0.4, 0.6
DISK_BYTES_PER_S = 2e9  # reading checkpoints (an assumed NVMe read; a network disk is slower)
USABLE = 0.9  # of a card's memory: the allocator's fragmentation and the CUDA context
# per position and adapted block, what the backward keeps in float32: the MLP's three intermediate
# vectors and about eight hidden-size ones (norms, q/k/v/o, residuals): 260 KB at 7B (docs/scale.md)
ACTIVATION_VECTORS = (3, 8)


@dataclass(frozen=True)
class Shape:
    """The decoder's sizes, from a model's config.json."""
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool = False  # Qwen2's q/k/v biases


    @classmethod
    def from_config(cls, config) -> "Shape":
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        hidden, heads = int(text.hidden_size), int(text.num_attention_heads)
        head_dim = getattr(text, "head_dim", None) or hidden // heads
        return cls(hidden=hidden, intermediate=int(text.intermediate_size), layers=int(text.num_hidden_layers),
                   heads=heads, kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
                   head_dim=int(head_dim), vocab=int(text.vocab_size),
                   tied=bool(getattr(config, "tie_word_embeddings", False)),
                   qkv_bias=bool(getattr(text, "attention_bias", text.model_type == "qwen2")))

    @property
    def block_linear_parameters(self) -> int:
        """q, k, v, o and the gated MLP's three linears of one block (grouped-query k/v and biases included)."""
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        bias = (q_out + 2 * kv_out) if self.qkv_bias else 0
        return self.hidden * (q_out + 2 * kv_out) + q_out * self.hidden + 3 * self.hidden * self.intermediate + bias

    @property
    def block_linear_sides(self) -> int:
        """Sum of (in + out) over a block's seven linears: a rank-1 adapter's parameters in one block."""
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return ((self.hidden + q_out) * 2 + (self.hidden + kv_out) * 2 + 3 * (self.hidden + self.intermediate))

    @property
    def parameters(self) -> int:
        """Embeddings, blocks (two norms each), final norm, and the head unless tied."""
        blocks = self.layers * (self.block_linear_parameters + 2 * self.hidden)
        return self.vocab * self.hidden * (1 if self.tied else 2) + blocks + self.hidden


@dataclass(frozen=True)
class Run:
    """What the plan needs of the surgery block, one domain at a time."""
    records: int              # calibration records (samples + synthesize)
    tokens: int               # positions per record
    continue_tokens: int
    held_out: float
    steps: int
    batch_records: Optional[int]
    micro_batch: Optional[int]
    depth: int                # adapted blocks
    loss: str
    kl_target: str
    kl_chunk: int
    kl_positions: Optional[int]
    early_stopping: bool
    refit: bool
    validation: float
    eval_every: int
    delta_start: bool
    bf16_weights: bool        # the capture's dtype (bfloat16 on a GPU by default)
    capture_batch: int = 8
    rank: int = 16            # the final-state content correction's
    trained: Optional[int] = None  # train_blocks: the adapted blocks a step runs (None: all of them)
    activation_fit: bool = False  # extract_fit: activations

    @property
    def stepped(self) -> int:
        """Blocks a training step runs forward and backward (the rest ran once, at their extract)."""
        return self.depth if self.trained is None else min(self.trained, self.depth)


def train_records(run: Run) -> Tuple[int, int]:
    """(records a step trains on in the stopped run, in the refit or the only run)."""
    held = int(round(run.held_out * run.records)) if run.held_out > 0 and run.records >= 2 else 0
    train = run.records - min(held, run.records - 1)
    validation = int(round(run.validation * train)) if run.early_stopping else 0
    return train - validation, train


def step_flops(shape: Shape, run: Run, records: int) -> Dict[str, float]:
    """One training step over ``records`` (or ``batch_records``): the adapted blocks forward and backward
    to their inputs, the KL's matmuls through the head (or none for the final-state losses)."""
    positions = min(records, run.batch_records or records) * run.tokens
    if run.kl_positions:
        positions = min(positions, run.kl_positions)
    attention = 4 * run.stepped * (run.tokens / 2) * shape.heads * shape.head_dim
    blocks = 2 * (2 * run.stepped * shape.block_linear_parameters + attention) * positions
    matmuls = 0 if run.loss != "kl" else (2 if run.kl_target != "exact" else 5)
    # the content correction's two [hidden x rank] matmuls, forward and backward (about 3x)
    correction = 3 * 2 * 2 * shape.hidden * run.rank * positions
    return {"blocks": blocks + correction, "kl": matmuls * 2 * positions * shape.hidden * shape.vocab}


def training_seconds(shape: Shape, run: Run, card: Card) -> float:
    """All of ``steps`` (early stopping can only stop sooner), the validation forwards and the refit."""
    block_rate = card.bf16_flops * MATMUL_EFFICIENCY if run.bf16_weights else card.fp32_flops
    stopped, refit = train_records(run)

    def seconds(steps: float, records: int) -> float:
        flops = step_flops(shape, run, records)
        return steps * (flops["blocks"] / block_rate + flops["kl"] / card.fp32_flops)

    if not run.early_stopping:
        return seconds(run.steps, refit)
    checks = run.steps / run.eval_every + 1  # a validation forward: about a third of a step
    validation = refit - stopped
    return (seconds(run.steps, stopped) + (seconds(run.steps, refit) if run.refit else 0.0)
            + seconds(checks / 3, validation))


def capture_seconds(shape: Shape, run: Run, card: Card) -> float:
    """The merge's and the expert's forward over every record (and the expert's head for the entropy),
    and the expert's greedy continuations (memory-bound: the weights read once per token and batch)."""
    rate = card.bf16_flops * MATMUL_EFFICIENCY if run.bf16_weights else card.fp32_flops
    tokens = run.records * run.tokens
    forward = 2 * 2 * shape.parameters * tokens + 2 * tokens * shape.hidden * shape.vocab
    decode = 0.0
    if run.continue_tokens:
        weight_bytes = shape.parameters * (2 if run.bf16_weights else 4)
        batches = math.ceil(run.records / run.capture_batch)
        decode = batches * run.continue_tokens * weight_bytes / (card.bandwidth * BANDWIDTH_EFFICIENCY)
    load = 2 * shape.parameters * (2 if run.bf16_weights else 4) / DISK_BYTES_PER_S
    return forward / rate + decode + load


def delta_seconds(shape: Shape, run: Run, card: Card) -> float:
    """The data-free start: every adapted linear of the expert and the merge read, one SVD each (about
    14·m·n·min(m, n) FLOPs, at a tenth of the float32 peak: SVDs run far below it)."""
    if not run.delta_start or not run.depth:
        return 0.0
    q_out, kv_out = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    sides = [(shape.hidden, q_out), (shape.hidden, kv_out), (shape.hidden, kv_out), (q_out, shape.hidden),
             *[(shape.hidden, shape.intermediate)] * 3]
    flops = run.depth * sum(14 * m * n * min(m, n) for m, n in sides)
    read = 2 * run.depth * shape.block_linear_parameters * 2 / DISK_BYTES_PER_S
    return flops / (0.1 * card.fp32_flops) + read + activation_fit_seconds(shape, run, card)


def activation_fit_seconds(shape: Shape, run: Run, card: Card) -> float:
    """``extract_fit: activations``: the adapted blocks forward once over the training records, the input
    Gram matrices (attention input, o_proj input, gate/up input, down_proj input: one each a block, float32)
    and their Cholesky factorizations (float64, on the same device)."""
    if not run.activation_fit or not run.delta_start or not run.depth:
        return 0.0
    _, records = train_records(run)
    positions = records * run.tokens
    block_rate = card.bf16_flops * MATMUL_EFFICIENCY if run.bf16_weights else card.fp32_flops
    q_out = shape.heads * shape.head_dim
    inputs = (shape.hidden, q_out, shape.hidden, shape.intermediate)
    forward = 2 * run.depth * shape.block_linear_parameters * positions / block_rate
    grams = 2 * run.depth * sum(width ** 2 for width in inputs) * positions / (card.fp32_flops * MATMUL_EFFICIENCY)
    cholesky = run.depth * sum(width ** 3 / 3 for width in inputs) / (card.fp64_flops * MATMUL_EFFICIENCY)
    return forward + grams + cholesky


def training_memory(shape: Shape, run: Run, micro_batch: Optional[int] = None) -> Dict[str, float]:
    """Bytes on the training device: the frozen blocks' float32 copy, the heads, the cached inputs and
    targets, the activations of one micro-batch and the KL's chunk buffers."""
    _, records = train_records(run)
    step_records = min(records, run.batch_records or records)
    active = min(step_records, micro_batch or step_records)
    positions, active_positions = records * run.tokens, active * run.tokens
    per_block = (ACTIVATION_VECTORS[0] * shape.intermediate + ACTIVATION_VECTORS[1] * shape.hidden) * 4
    kl = run.loss == "kl"
    parts = {
        "frozen blocks (float32)": 4 * run.depth * (shape.block_linear_parameters + 2 * shape.hidden),
        "heads (float32)": 4 * shape.vocab * shape.hidden * (2 if kl and run.kl_target == "exact" else 1),
        "cached states": 4 * positions * shape.hidden * (3 if run.depth else 2),
        "cached KL target": (2 if run.kl_target == "bf16" else 0) * positions * shape.vocab if kl else 0,
        "activations": per_block * active_positions * run.stepped,
        "KL buffers": 3 * 4 * min(active_positions, run.kl_chunk if run.kl_chunk else active_positions)
                      * shape.vocab if kl else 0,
    }
    return parts


def capture_memory(shape: Shape, run: Run) -> Dict[str, float]:
    """Bytes on the capture device: one model's weights at the capture dtype (merge and expert are loaded
    one at a time), one batch's states and the head's float32 logits for the entropy."""
    weight = 2 if run.bf16_weights else 4
    return {"weights": weight * shape.parameters,
            "one batch": run.capture_batch * run.tokens * (shape.hidden * 4 * 4 + shape.vocab * 4 * 2)}


def fitting_micro_batch(shape: Shape, run: Run, card: Card) -> Tuple[Optional[int], float]:
    """The largest micro-batch (records) whose training fits the card, and its bytes; (None, bytes at
    one record) when not even one record fits."""
    _, records = train_records(run)
    step_records = min(records, run.batch_records or records)
    for micro in sorted({step_records, *[2 ** k for k in range(12) if 2 ** k < step_records]}, reverse=True):
        total = sum(training_memory(shape, run, micro).values())
        if total <= card.memory_gb * GB * USABLE:
            return micro, total
    return None, sum(training_memory(shape, run, 1).values())


def run_from_surgery(surgery, domain: str, layers: int, tokens: Optional[int] = None,
                     on_gpu: bool = True) -> Run:
    """The plan's view of one domain of a validated ``SurgeryConfig`` (its preset already expanded)."""
    calibration = surgery.domains[domain].calibration
    depth = layers if surgery.depth == "all" else min(int(surgery.depth), layers)
    dtype = surgery.dtype if surgery.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
    return Run(records=calibration.samples + calibration.synthesize, tokens=tokens or surgery.max_positions,
               continue_tokens=calibration.continue_tokens, held_out=surgery.held_out, steps=surgery.steps,
               batch_records=surgery.batch_size, micro_batch=surgery.micro_batch_size, depth=depth,
               loss=surgery.loss, kl_target=surgery.kl_target, kl_chunk=surgery.kl_chunk_size,
               kl_positions=surgery.kl_positions_per_step, early_stopping=surgery.early_stopping,
               refit=surgery.refit, validation=surgery.validation, eval_every=surgery.eval_every,
               delta_start=surgery.adapter_init == "delta", bf16_weights=dtype == "bfloat16",
               capture_batch=surgery.capture_batch_size, rank=surgery.rank,
               trained=None if surgery.train_blocks in (None, "all") else int(surgery.train_blocks),
               activation_fit=surgery.extract_fit == "activations")


def plan_domain(shape: Shape, run: Run, card: Card) -> dict:
    """Seconds and bytes of one domain's stages on ``card``, and what makes training fit."""
    micro, fitting_bytes = fitting_micro_batch(shape, run, card)
    written = run.micro_batch
    train_bytes = sum(training_memory(shape, run, written).values())
    return {
        "capture": {"seconds": capture_seconds(shape, run, card), "bytes": sum(capture_memory(shape, run).values())},
        "delta start": {"seconds": delta_seconds(shape, run, card), "bytes": 0.0},
        "training": {"seconds": training_seconds(shape, run, card), "bytes": train_bytes,
                     "parts": training_memory(shape, run, written)},
        "fits": train_bytes <= card.memory_gb * GB * USABLE,
        "micro_batch_that_fits": micro, "bytes_at_that_micro_batch": fitting_bytes,
    }


def merge_seconds(shape: Shape, models: int) -> float:
    """mergekit reads every input model once and writes the merge (bfloat16 checkpoints assumed)."""
    return (models + 1) * 2 * shape.parameters / DISK_BYTES_PER_S


def advice(shape: Shape, run: Run, card: Card, result: dict) -> List[str]:
    """What to set so the run fits ``card``: micro_batch_size, the capture's placement, or fewer blocks."""
    lines = []
    usable = card.memory_gb * GB * USABLE
    if result["capture"]["bytes"] > usable:
        lines.append("capture: the weights do not fit: set `device_map: auto` (with `max_memory`) to spread "
                     "them over GPUs, CPU and disk (docs/scale.md)")
    if not result["fits"]:
        micro = result["micro_batch_that_fits"]
        if micro is not None:
            lines.append(f"training: set `micro_batch_size: {micro}` (the same step, "
                         f"{result['bytes_at_that_micro_batch'] / GB:.0f} GB)")
        else:
            frozen = training_memory(shape, run, 1)["frozen blocks (float32)"]
            lines.append(f"training: does not fit even one record at a time (the frozen blocks alone are "
                         f"{frozen / GB:.0f} GB in float32): a larger card, or a smaller `depth`")
    return lines
