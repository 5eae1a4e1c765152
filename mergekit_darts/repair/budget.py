"""The parameter budget of one domain's correction on a 7B-shaped model (docs/quality.md).

The budget is 0.1 % of the model per domain (``BUDGET_SHARE``). The paper's setting adds 2.2 M parameters
per domain, 0.033 % of a 7B model: about 0.1 % for its three domains together, so the per-domain budget
allows three times that. ``mergekit-darts info`` shows what the directory's settings would add to a
Llama-2-7B-shaped model, so the budget can be checked on a tiny output too.
"""

from typing import Dict, List, Tuple

# Llama-2-7B: hidden 4096, vocabulary 32000, 32 layers, MLP 11008, untied embeddings and head
SHAPE_7B = {"hidden_size": 4096, "vocab_size": 32000, "layers": 32, "intermediate_size": 11008}
BUDGET_SHARE = 1e-3
# What a preset may add per domain: a rank-8 LoRA on every linear of the 7B shape with the rank-64
# content correction and position table beside it (0.3355 %; preset: best has no table since 2026-12-06:
# 0.3044 %), a common per-task size in multi-LoRA serving
PRESET_SHARE = 3.4e-3


def model_parameters(hidden_size: int, vocab_size: int, layers: int, intermediate_size: int) -> int:
    """Parameters of a Llama-shaped model (full attention, SwiGLU MLP, RMSNorm, untied head)."""
    per_layer = 4 * hidden_size * hidden_size + 3 * hidden_size * intermediate_size + 2 * hidden_size
    return 2 * vocab_size * hidden_size + layers * per_layer + hidden_size


def block_linear_sizes(hidden_size: int, intermediate_size: int) -> int:
    """Sum of (in + out) features over a Llama block's seven linears (q, k, v, o, gate, up, down)."""
    return 4 * (2 * hidden_size) + 3 * (hidden_size + intermediate_size)


def _blocks(settings: Dict, layers: int) -> Tuple[str, int]:
    """How many of the 7B shape's blocks ``depth`` adapts: all of them when the settings adapt every
    block of their own model (``settings["layers"]``, the merged model's decoder layers), else ``depth``."""
    depth, own = int(settings["depth"]), settings.get("layers")
    if own and depth >= int(own):
        return f"{layers} (all)", layers
    return str(depth), depth


def _terms(settings: Dict, hidden_size: int, vocab_size: int, intermediate_size: int,
           layers: int = SHAPE_7B["layers"]) -> List[Tuple[str, int]]:
    """(formula term, parameters) of each part of one domain's correction."""
    h, v = hidden_size, vocab_size
    terms = [(f"2·{settings['rank']}·{h}", 2 * int(settings["rank"]) * h)]  # content
    if settings.get("method", "darts") == "darts":  # position table
        terms.append((f"{settings['max_positions']}·{h}", int(settings["max_positions"]) * h))
    if settings.get("head_rank"):  # head correction
        terms.append((f"{settings['head_rank']}·({h}+{v})", int(settings["head_rank"]) * (h + v)))
    if settings.get("depth"):  # adapters on every linear of the last `depth` blocks
        sizes = block_linear_sizes(h, intermediate_size)
        label, blocks = _blocks(settings, layers)
        terms.append((f"{label}·{settings['depth_rank']}·{sizes}", blocks * int(settings["depth_rank"]) * sizes))
    return terms


def correction_parameters(settings: Dict, hidden_size: int, vocab_size: int,
                          intermediate_size: int = SHAPE_7B["intermediate_size"]) -> int:
    """2·r·H (content) + T·H (darts position table) + r_h·(H + V) (head correction)
    + k·r_k·sum(in + out) (depth: adapters on every linear of the last k blocks)."""
    return sum(count for _, count in _terms(settings, hidden_size, vocab_size, intermediate_size))


def share_of_7b(settings: Dict) -> Dict:
    """{parameters, model_parameters, share, within_budget, formula} for the 7B shape. Adapters on
    every block of the settings' own model (``depth`` >= ``settings["layers"]``) count all 32 blocks."""
    h, v = SHAPE_7B["hidden_size"], SHAPE_7B["vocab_size"]
    terms = _terms(settings, h, v, SHAPE_7B["intermediate_size"])
    parameters = sum(count for _, count in terms)
    model = model_parameters(**SHAPE_7B)
    return {"parameters": parameters, "model_parameters": model, "share": parameters / model,
            "within_budget": parameters / model <= BUDGET_SHARE,
            "formula": " + ".join(label for label, _ in terms)
            + f" = {parameters:,} of {model:,} (H {h}, V {v}, {SHAPE_7B['layers']} layers)"}


def describe_share(budget: Dict) -> str:
    """One line for ``info`` and ``report``: the share, the verdict against the budget, the formula."""
    verdict = "within" if budget["within_budget"] else "OVER"
    return (f"{100 * budget['share']:.4f}% per domain on a 7B shape ({verdict} the "
            f"{100 * BUDGET_SHARE:g}% budget): {budget['formula']}")
