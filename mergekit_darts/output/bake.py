"""Fold one domain's correction into the weights: a plain model directory (``mergekit-darts bake``).

With ``content: linear`` the corrected state is ``ĥ = (I − U·D)·h`` and the logits are
``W·ĥ + H_u·H_d·ĥ``, so a domain's whole correction is one matrix: ``W' = (W + H_u·H_d)·(I − U·D)``
(U = up.weight, D = down.weight, H_u/H_d = head_up/head_down.weight). The per-position bias table
adds a position-dependent term and cannot be folded; a ReLU content correction is not linear. Both are
the *final-state correction*: ``--drop-final-state-correction`` drops it whole (``output/dropped.py``
says what that leaves out), so the head becomes ``W + H_u·H_d``. Block adapters (``depth``,
``y = W·x + A_up·A_down·x``) fold exactly into their linears: ``W + A_up·A_down``, and an adapter's bias
(on a linear with a bias, Qwen2's q/k/v) into the linear's bias.

The baked directory is the merge's own architecture: no ``auto_map``, no ``darts`` entry, no remote
code. Tensors are streamed one at a time from the merged shards (``safe_open``) into new safetensors
files written by hand, a folded one made only as it is written (``Replacement``), so memory stays near
the largest tensor; everything is written into a staging directory beside DEST and switched in with one
``os.replace`` (``staging.staged_directory``: SIGINT and SIGTERM remove the partial copy).
"""

import json
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from safetensors import safe_open

from mergekit_darts.errors import FoldError, FormatError
from mergekit_darts.output import card, dropped, layout
from mergekit_darts.output.layout import DARTS_SHARD, INDEX, SINGLE_WEIGHTS
from mergekit_darts.output.staging import staged_directory
from mergekit_darts.remote_code.surgery import SurgeryShape

LOG = logging.getLogger(__name__)

HEAD_KEY = "lm_head.weight"
EMBED_KEY = "model.embed_tokens.weight"  # every supported architecture keeps it here
# files of OUT that a plain model must not carry (remote code, darts weights and report) or that are rewritten
NOT_COPIED = {*layout.MODELING_FILES, DARTS_SHARD, INDEX, SINGLE_WEIGHTS, layout.REPORT, layout.PLOT,
              layout.CARD, "config.json"}
ROW_CHUNK = 8192  # vocabulary rows folded at once (float64): bounds the fold's extra memory
FOLDABLE_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors dtypes a folded tensor may have


@dataclass
class DomainFold:
    """What a domain's correction is as LM-head matrices (float32, CPU); head_* are None at head_rank 0."""

    domain: str
    shape: SurgeryShape
    up: torch.Tensor  # U: hidden × rank
    down: torch.Tensor  # D: rank × hidden
    head_up: Optional[torch.Tensor]  # H_u: vocab × head_rank
    head_down: Optional[torch.Tensor]  # H_d: head_rank × hidden
    dropped_position_bias: bool
    # depth > 0: {"<layer>.<path in the block>": (down [r × in], up [out × r])}
    blocks: Optional[Dict[str, tuple]] = None
    # the adapters' biases (``up.bias`` [out], on linears with a bias), by the same names; a directory
    # written before adapters had biases has none (they are zero)
    block_biases: Optional[Dict[str, torch.Tensor]] = None
    dropped_final_state: bool = False  # up/down are then None: the head keeps only H_u·H_d
    dropped_lora_bias: bool = False  # block_biases were read and left out (--drop-lora-bias)

    @property
    def changes_head(self) -> bool:
        return self.up is not None or self.head_up is not None


def load_domain_fold(out_dir: str, domain: str, drop_position_bias: bool = False,
                     drop_final_state: bool = False, drop_lora_bias: bool = False) -> DomainFold:
    """Read ``domain``'s tensors from ``out_dir`` after checking that they fold exactly (a depth
    output's block adapters included); ``drop_final_state``: without the final-state correction;
    ``drop_lora_bias``: without the block adapters' biases (Qwen2's q/k/v; vLLM and llama.cpp take no
    LoRA bias)."""
    meta = layout.read_darts_entry(out_dir)
    shape = SurgeryShape.from_meta(meta)
    domains = list(meta.get("domains") or {})
    if domain not in domains:
        raise FoldError(f"--domain: unknown domain {domain!r}; {out_dir} has {', '.join(domains) or 'none'}")
    check_foldable(shape, drop_position_bias, drop_final_state)
    shard = os.path.join(out_dir, DARTS_SHARD)
    if not os.path.isfile(shard):
        raise FormatError(f"{out_dir}: no {DARTS_SHARD}; the surgery export is incomplete")
    names = ([] if drop_final_state else ["up.weight", "down.weight"]) + (
        ["head_up.weight", "head_down.weight"] if shape.head_rank else [])
    tensors = {}
    with safe_open(shard, framework="pt") as handle:
        available = set(handle.keys())
        for name in names:
            key = layout.darts_tensor_name(domain, name)
            if key not in available:
                raise FormatError(f"{shard}: missing tensor {key}")
            tensors[name] = handle.get_tensor(key).float()
        blocks, biases = _block_factors(handle, available, domain, shard) if shape.depth else (None, None)
    dropped_bias = bool(drop_lora_bias and biases)
    return DomainFold(domain=domain, shape=shape, up=tensors.get("up.weight"), down=tensors.get("down.weight"),
                      head_up=tensors.get("head_up.weight"), head_down=tensors.get("head_down.weight"),
                      dropped_position_bias=shape.method == "darts", blocks=blocks,
                      block_biases=None if drop_lora_bias else biases, dropped_final_state=drop_final_state,
                      dropped_lora_bias=dropped_bias)


def _block_factors(handle, available, domain: str, shard: str) -> Tuple[Dict[str, tuple], Dict[str, torch.Tensor]]:
    """({name: (down, up)}, {name: up.bias} of the adapters that have one)."""
    prefix = layout.darts_tensor_name(domain, "blocks.")
    names = sorted(key[len(prefix):-len(".down.weight")] for key in available
                   if key.startswith(prefix) and key.endswith(".down.weight"))
    if not names:
        raise FormatError(f"{shard}: no block adapter tensors ({prefix}*) for a depth output")
    factors, biases = {}, {}
    for name in names:
        up_key = f"{prefix}{name}.up.weight"
        if up_key not in available:
            raise FormatError(f"{shard}: missing tensor {up_key}")
        factors[name] = (handle.get_tensor(f"{prefix}{name}.down.weight").float(), handle.get_tensor(up_key).float())
        if f"{prefix}{name}.up.bias" in available:
            biases[name] = handle.get_tensor(f"{prefix}{name}.up.bias").float()
    return factors, biases


def check_foldable(shape: SurgeryShape, drop_position_bias: bool, drop_final_state: bool = False) -> None:
    """Every reason the correction cannot be folded into weights, in one error (so a retrain that
    fixes one reason does not meet the next only then)."""
    if drop_final_state:
        if not shape.depth and not shape.head_rank:
            raise FoldError(
                "--drop-final-state-correction: this output has no block adapters (depth: 0) and no head correction "
                "(head_rank: 0), so nothing would remain; export it without the flag (content: linear) or serve it "
                "with trust_remote_code")
        return
    reasons = []
    rest = [f"the block adapters (depth: {shape.depth})"] if shape.depth else []
    rest += [f"the head correction (head_rank: {shape.head_rank})"] if shape.head_rank else []
    keep = (f"pass --drop-final-state-correction to export {' and '.join(rest)} without it (the command says what "
            "is dropped), " if rest else "")
    if shape.content != "linear":
        reasons.append(
            f"content: {shape.content!r} — a ReLU content correction is not linear and has no weight form; "
            f"{keep}retrain with `content: linear` in the surgery: block, or serve the directory with trust_remote_code")
    if shape.method == "darts" and not drop_position_bias:
        reasons.append(
            "method: 'darts' — its per-position bias table cannot be folded into the LM head; pass "
            "--drop-position-bias to fold the rest (it prints the held-out KL with and without the table), "
            "or retrain with `method: standard`")
    if len(reasons) == 1:
        raise FoldError(reasons[0])
    if reasons:
        raise FoldError(f"{len(reasons)} reasons this output cannot be folded: "
                        + "; and ".join(f"({i}) {r}" for i, r in enumerate(reasons, 1)))


def merged_head_source(out_dir: str, config: dict) -> str:
    """The tensor that is the merged LM head as transformers 5 loads it: ``lm_head.weight`` when the
    checkpoint has one (with ``tie_word_embeddings: true`` and a *different* ``lm_head.weight`` it does not
    tie them: "both are present in the checkpoints with different values"), else the input embeddings."""
    names = layout.merged_weight_map(out_dir)
    if HEAD_KEY in names:
        return HEAD_KEY
    if EMBED_KEY in names:
        return EMBED_KEY
    raise FormatError(f"{out_dir}: neither {HEAD_KEY} nor {EMBED_KEY} in the merged weights")


def read_merged_tensor(out_dir: str, name: str) -> torch.Tensor:
    with safe_open(layout.shard_path(out_dir, layout.merged_weight_map(out_dir)[name]), framework="pt") as handle:
        return handle.get_tensor(name)


@torch.no_grad()
def folded_head(head: torch.Tensor, fold: DomainFold) -> torch.Tensor:
    """``W' = (W + H_u·H_d)·(I − U·D)`` (without the final-state correction: ``W + H_u·H_d``) in float64,
    cast to the head's dtype, ``ROW_CHUNK`` rows at a time."""
    out = torch.empty_like(head)
    for start in range(0, head.shape[0], ROW_CHUNK):
        rows = head[start:start + ROW_CHUNK].double()
        if fold.head_up is not None:
            rows = rows + fold.head_up[start:start + ROW_CHUNK].double() @ fold.head_down.double()
        if fold.up is not None:
            rows = rows - (rows @ fold.up.double()) @ fold.down.double()
        out[start:start + ROW_CHUNK] = rows.to(head.dtype)
    return out


def block_weight_name(name: str, part: str = "weight") -> str:
    """The merged weight (or ``part="bias"``: bias) of the linear that block adapter ``<layer>.<path>`` sits on."""
    return f"model.layers.{name}.{part}"


@dataclass
class Replacement:
    """A tensor of the baked weights that is made only when its bytes are written (``make()``), so one
    folded tensor is alive at a time; its safetensors ``dtype`` and ``shape`` go in the header first."""

    dtype: str
    shape: List[int]
    make: Callable[[], torch.Tensor]


def merged_tensor_info(out_dir: str) -> Dict[str, dict]:
    """Tensor name -> its safetensors header entry (dtype, shape) for the merged weights (headers only)."""
    weight_map = layout.merged_weight_map(out_dir)
    info = {}
    for file_name in sorted(set(weight_map.values())):
        header = layout.safetensors_header(layout.shard_path(out_dir, file_name))
        info.update({name: entry for name, entry in header.items() if weight_map.get(name) == file_name})
    return info


@torch.no_grad()
def folded_tensor(out_dir: str, key: str, adapter) -> torch.Tensor:
    """The merged ``key`` with its adapter folded in, in float64 cast to the merged dtype: ``W + A_up·A_down``
    for an adapter ``(down, up)``, ``b + b_A`` for an adapter's bias."""
    merged = read_merged_tensor(out_dir, key)
    delta = adapter[1].double() @ adapter[0].double() if isinstance(adapter, tuple) else adapter.double()
    return (merged.double() + delta).to(merged.dtype)


def folded_block_weights(out_dir: str, fold: DomainFold, info: Optional[Dict[str, dict]] = None
                         ) -> Dict[str, Replacement]:
    """Every adapted linear's ``W + A_up·A_down`` and, where the adapter has a bias, the linear's
    ``b + b_A``: checked against the merged headers now, each folded (``folded_tensor``) only when written."""
    info = merged_tensor_info(out_dir) if info is None else info
    folded = {}
    for name, (down, up) in sorted((fold.blocks or {}).items()):
        key = block_weight_name(name)
        if key not in info:
            raise FormatError(f"{out_dir}: the block adapter {name} of domain {fold.domain!r} has no merged weight "
                              f"{key} to fold into")
        if tuple(info[key]["shape"]) != (up.shape[0], down.shape[1]):
            raise FormatError(f"{out_dir}: {key} is {tuple(info[key]['shape'])}, its adapter is "
                              f"{up.shape[0]} × {down.shape[1]}")
        folded[key] = replacement(out_dir, key, info[key], lambda k=key, a=(down, up): folded_tensor(out_dir, k, a))
    for name, bias in sorted((fold.block_biases or {}).items()):
        key = block_weight_name(name, "bias")
        if key not in info:
            raise FormatError(f"{out_dir}: the block adapter {name} of domain {fold.domain!r} has a bias but the "
                              f"merge has no {key} to fold it into")
        if tuple(info[key]["shape"]) != tuple(bias.shape):
            raise FormatError(f"{out_dir}: {key} is {tuple(info[key]['shape'])}, its adapter's bias "
                              f"{tuple(bias.shape)}")
        folded[key] = replacement(out_dir, key, info[key], lambda k=key, b=bias: folded_tensor(out_dir, k, b))
    return folded


def replacement(out_dir: str, key: str, entry: dict, make: Callable[[], torch.Tensor]) -> Replacement:
    """``make``'s tensor, which has the merged ``key``'s dtype and shape (``entry``: its header entry); that
    dtype must be one the fold computes in."""
    if entry["dtype"] not in FOLDABLE_DTYPES:
        raise FormatError(f"{out_dir}: {key} has dtype {entry['dtype']}, not a floating-point type mergekit-darts "
                          f"can bake ({', '.join(FOLDABLE_DTYPES)})")
    return Replacement(entry["dtype"], list(entry["shape"]), make)


# ---------------------------------------------------------------------------------------------- writing

def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def write_safetensors(path: str, entries: List[tuple]) -> int:
    """Write ``entries`` [(name, dtype string, shape, producer)] as one safetensors file, calling each
    ``producer()`` (returns the tensor) only when its bytes are written. Returns the data size."""
    header, offset = {}, 0
    for name, dtype, shape, _ in entries:
        count = 1
        for dim in shape:
            count *= dim
        size = count * _DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors aligns the data to 8 bytes
    with open(path, "wb") as handle:
        handle.write(len(encoded).to_bytes(8, "little"))
        handle.write(encoded)
        for name, _, _, producer in entries:
            data = _tensor_bytes(producer())
            if len(data) != header[name]["data_offsets"][1] - header[name]["data_offsets"][0]:
                raise FormatError(f"{path}: tensor {name} changed size while being written")
            handle.write(data)
    return offset


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


def write_weights(out_dir: str, dest: str, replace: Dict[str, Replacement]) -> None:
    """The merged weights of ``out_dir`` into ``dest`` with ``replace``'d tensors (name -> Replacement, made
    as it is written; a name the merge lacks is added to the shard holding the embeddings); one shard keeps
    ``model.safetensors``."""
    weight_map = layout.merged_weight_map(out_dir)
    files = sorted(set(weight_map.values()))
    added = {name: weight_map.get(name, weight_map.get(EMBED_KEY, files[0])) for name in replace}
    single = len(files) == 1
    total, new_map = 0, {}
    for file_name in files:
        source = layout.shard_path(out_dir, file_name)
        header = layout.safetensors_header(source)
        target_name = SINGLE_WEIGHTS if single else file_name
        with safe_open(source, framework="pt") as handle:
            entries = []
            for name in sorted(n for n, f in weight_map.items() if f == file_name and n not in replace):
                info = header[name]
                entries.append((name, info["dtype"], info["shape"], lambda n=name: handle.get_tensor(n)))
            for name in sorted(n for n, f in added.items() if f == file_name):
                entries.append((name, replace[name].dtype, replace[name].shape, replace[name].make))
            entries.sort(key=lambda entry: entry[0])
            total += write_safetensors(os.path.join(dest, target_name), entries)
        new_map.update({entry[0]: target_name for entry in entries})
    if not single:
        layout.write_json(os.path.join(dest, INDEX),
                          {"metadata": {"total_size": total}, "weight_map": dict(sorted(new_map.items()))})


def copy_plain_files(out_dir: str, dest: str) -> List[str]:
    """Tokenizer files, generation config, mergekit_config.yml ...: every plain file that is not a weight,
    remote code, the darts report or a file the bake rewrites."""
    copied = []
    for name in sorted(os.listdir(out_dir)):
        path = os.path.join(out_dir, name)
        if (name in NOT_COPIED or name.endswith(".safetensors") or name.startswith(".")
                or not os.path.isfile(path)):
            continue
        shutil.copyfile(path, os.path.join(dest, name))
        copied.append(name)
    return copied


# ---------------------------------------------------------------------------------------------- bake

def held_out_kl_note(out_dir: str, domain: str) -> Optional[dict]:
    """The domain's held-out KL entry of darts_report.json (measured when the surgery was trained)."""
    path = os.path.join(out_dir, layout.REPORT)
    if not os.path.isfile(path):
        return None
    return (layout.read_json(path).get("domains", {}).get(domain) or {}).get("held_out_kl")


def bake(out_dir: str, domain: str, dest: str, drop_position_bias: bool = False,
         drop_final_state: bool = False) -> dict:
    """Write ``dest``: the merge of ``out_dir`` with ``domain``'s correction folded into its LM head and,
    with depth, its block adapters into their linears. Returns a summary (domain, head source, what was
    dropped, held-out KL)."""
    fold = load_domain_fold(out_dir, domain, drop_position_bias, drop_final_state)
    if os.path.exists(dest):
        raise FoldError(f"DEST: {os.path.abspath(dest)} already exists; choose a new directory (nothing was overwritten)")
    config = layout.read_config(out_dir)
    source = merged_head_source(out_dir, config)
    info = merged_tensor_info(out_dir)
    replace = folded_block_weights(out_dir, fold, info)  # checked now, folded one at a time as written
    if fold.changes_head:
        replace[HEAD_KEY] = replacement(out_dir, source, info[source],
                                        lambda: folded_head(read_merged_tensor(out_dir, source), fold))
    meta = layout.read_darts_entry(out_dir)
    kl = held_out_kl_note(out_dir, domain)
    summary = {"domain": domain, "head_source": source if fold.changes_head else None,
               "dropped_position_bias": fold.dropped_position_bias, "dropped_final_state": fold.dropped_final_state,
               "rank": fold.shape.rank, "head_rank": fold.shape.head_rank, "block_linears": len(fold.blocks or {}),
               "held_out_kl": kl, "expert": (meta.get("domains") or {}).get(domain), "shape": fold.shape,
               "hidden_size": config.get("hidden_size")}

    def write(stage):
        write_weights(out_dir, stage, replace)
        plain = layout.plain_config(config)
        if fold.changes_head:  # the folded head is domain-specific; the input embeddings are not
            plain["tie_word_embeddings"] = False
        layout.write_json(os.path.join(stage, "config.json"), plain)
        copy_plain_files(out_dir, stage)
        with open(os.path.join(stage, layout.CARD), "w", encoding="utf-8") as handle:
            plain_fold = not fold.dropped_final_state and not fold.blocks  # the head-only fold card.py describes
            section = (card.baked_section if plain_fold else dropped.baked_section)(summary, meta)
            handle.write(card.updated_card(out_dir, section))

    staged_directory(dest, write)
    return summary
