"""Pre-merge checks on weight files, from their safetensors headers alone (no tensor data is read):

- every expert's (and ``synthesize_writer``'s) files are whole: a bad length field, a header that is
  not JSON, a file cut short. Before, capture met them after the merge, in one line without the file's name;
- with block adapters (``depth > 0``) and ``adapter_init: delta`` the run starts each adapter from expert −
  merge of its linear (``repair/train/delta_init.py``): those expert tensors must have the merge's shapes,
  or the run ended in a raw RuntimeError after the merge and the capture. (With ``adapter_init: zero`` the
  same deltas only measure the report's ``baseline``, which an expert of other shapes leaves
  ``not_measured`` with the reason: the run is not refused.)

The merge's shapes are its inputs': mergekit's methods write each tensor in the shape of the base model's
(``base_model``, else the first of ``models``); a layer-stacking ``slices:`` merge takes decoder layer j from
the slice that produces it (that slice's base model, else its first source, at the layer ``layer_range``
gives), so a merge with more layers than its base is compared layer by layer with the right source.
``modules:`` merges are not checked (no false alarm), nor models whose weights are not in safetensors
files here (a Hub id not cached yet): capture still reads them as before.
"""

import itertools
import json
import os
import re
from typing import Dict, List, Optional, Tuple

from mergekit_darts.config import SurgeryConfig, SurgeryConfigError
from mergekit_darts.weight_files import (
    DARTS_SHARD, DARTS_TENSOR_PREFIX, INDEX, SINGLE_WEIGHTS, DamagedWeights, safetensors_header, unique_name_ending,
)

Shapes = Dict[str, Tuple[int, ...]]
_LAYER_WEIGHT = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)\.weight$")


def header_shapes(path: str) -> Shapes:
    """Tensor name -> shape from the header of ``path`` (``weight_files.safetensors_header``: a damaged file
    is ``DamagedWeights``)."""
    return {name: tuple(info["shape"]) for name, info in safetensors_header(path).items()}


def local_model_dir(path: str) -> Optional[str]:
    """The folder holding ``path``'s files: itself, or its cached Hub snapshot; None when neither is here."""
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        return os.path.realpath(expanded)
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached: capture fetches it (or says why it cannot)
        return None


def model_shapes(model_dir: str, where: str, what: str) -> Optional[Shapes]:
    """Every tensor's shape in ``model_dir``'s safetensors files (``darts.*`` of an earlier export left
    out); None when it has none. A damaged file is one line naming it."""
    index = os.path.join(model_dir, INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as handle:
                files = sorted(set(json.load(handle)["weight_map"].values()) - {DARTS_SHARD})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise SurgeryConfigError(f"{where}: {what}: {index} is damaged ({type(error).__name__}); download or "
                                     "copy the model again") from None
    elif os.path.isfile(os.path.join(model_dir, SINGLE_WEIGHTS)):
        files = [SINGLE_WEIGHTS]
    else:
        return None
    shapes: Shapes = {}
    for name in files:
        path = os.path.join(model_dir, name)
        try:
            shapes.update(header_shapes(path))
        except OSError as error:  # a shard the index names is missing, unreadable, ...
            raise SurgeryConfigError(f"{where}: {what}: weight file {path}: {error.strerror or error}; download "
                                     "or copy the model again") from None
        except DamagedWeights as error:
            raise SurgeryConfigError(f"{where}: {what}: weight file {path} is damaged: {error.reason}; download or "
                                     "copy the model again (an interrupted download or copy?)") from None
    return {name: shape for name, shape in shapes.items() if not name.startswith(DARTS_TENSOR_PREFIX)}


def layer_linears(shapes: Shapes, layer: int) -> Dict[str, Tuple[int, ...]]:
    """Path in the block -> shape of decoder layer ``layer``'s linear weights (2-D ``layers.N.<path>.weight``),
    a MoE router (``gate``/``router`` beside ``experts``) left out, as ``blocks.block_linear_targets`` does."""
    found = {}
    for name, shape in shapes.items():
        match = _LAYER_WEIGHT.search(name)
        if match and int(match.group(1)) == layer and len(shape) == 2:
            found[match.group(2)] = shape

    from mergekit_darts.remote_code.blocks import is_moe_router  # imports torch: only when depth is checked

    def has_experts(parent):
        prefix = f"{parent}.experts." if parent else "experts."
        return any(other.startswith(prefix) for other in found)
    return {path: shape for path, shape in found.items() if not is_moe_router(path, has_experts)}


def merged_layer_sources(merge_config, reference_path: str, reference_layers: Optional[int]
                         ) -> Optional[List[Tuple[str, int]]]:
    """(model, its layer index) of each decoder layer of the merge, in order; None when unknown."""
    if getattr(merge_config, "modules", None):
        return None
    slices = getattr(merge_config, "slices", None)
    if not slices:
        return None if reference_layers is None else [(reference_path, i) for i in range(reference_layers)]
    sources = []
    for output in slices:
        base = output.base_model or merge_config.base_model
        chosen = next((s for s in output.sources if base is not None and s.model == base), output.sources[0])
        start, stop = chosen.layer_range
        sources += [(str(chosen.model.model.path), layer) for layer in range(start, stop)]
    return sources


def check_weight_files(surgery: SurgeryConfig, layer_sources: Optional[List[Tuple[str, int]]],
                       merged_label: str = "the merge") -> None:
    """Every expert's and writer's safetensors headers are whole; with ``depth > 0`` and ``adapter_init: delta``
    every adapted linear the run reads from an expert has the merge's shape (``layer_sources``:
    ``merged_layer_sources``)."""
    experts = {}
    for name, domain in surgery.domains.items():
        where = f"surgery.domains.{name}.model"
        folder = local_model_dir(domain.model)
        experts[name] = model_shapes(folder, where, f"expert {domain.model!r}") if folder else None
        writer = domain.calibration.synthesize_writer
        folder = local_model_dir(writer) if writer else None
        if folder:
            model_shapes(folder, f"surgery.domains.{name}.calibration.synthesize_writer", repr(writer))
    if surgery.depth == 0 or surgery.adapter_init != "delta" or not layer_sources:
        return
    depth = len(layer_sources) if surgery.depth == "all" else min(surgery.depth, len(layer_sources))
    first = len(layer_sources) - depth
    references: Dict[str, Optional[Shapes]] = {}
    why = "adapter_init: delta starts each block adapter from expert − merge of its linear"
    for index, (source, layer) in enumerate(layer_sources[first:], start=first):
        if source not in references:
            folder = local_model_dir(source)
            references[source] = model_shapes(folder, "config", f"merge input {source!r}") if folder else None
        if references[source] is None:
            continue
        reference = references[source]
        for path, weight_shape in sorted(layer_linears(reference, layer).items()):
            # and its bias, where the merge has one: the run reads the expert's to see what it moved
            merged_bias = unique_name_ending(reference, f"layers.{layer}.{path}.bias")
            wanted = [("weight", weight_shape)] + ([("bias", reference[merged_bias])] if merged_bias else [])
            for (kind, merged_shape), (name, shapes) in itertools.product(wanted, experts.items()):
                if shapes is None:
                    continue
                suffix = f"layers.{index}.{path}.{kind}"
                model = surgery.domains[name].model
                tensor = unique_name_ending(shapes, suffix)
                if tensor is None:
                    raise SurgeryConfigError(
                        f"surgery.domains.{name}.model: expert {model!r} has no tensor '*{suffix}' ({merged_label}'s "
                        f"decoder layer {index}, depth {surgery.depth}); {why}: use an expert with the merge's "
                        "layers, a smaller depth, or adapter_init: zero")
                if shapes[tensor] != merged_shape:
                    raise SurgeryConfigError(
                        f"surgery.domains.{name}.model: expert {model!r} has {tensor} of shape {list(shapes[tensor])}, "
                        f"but {merged_label}'s is {list(merged_shape)} (layer {layer} of {source}); {why}, so the "
                        "expert needs the merge's shapes (intermediate_size, num_key_value_heads, ...): use a "
                        "fine-tune of the merge's base model, or adapter_init: zero")
