"""The plain merged model as a directory of its own: the base that ``export-peft``'s adapters sit on.

``out/`` itself is no plain base for other tools: its ``config.json`` names ``DartsLlamaForCausalLM``
(llama.cpp's ``convert_lora_to_gguf.py --base out/`` stops with "Model DartsLlamaForCausalLM is not
supported") and, for a tied merge, its LM head *is* the input embedding matrix, so a LoRA on
``lm_head`` has no matrix of its own to land on (llama.cpp: "LoRA tensor 'output.weight' does not
exist in base model"; PEFT's ``merge_and_unload`` writes the head's correction into the embeddings).

This writes the plain architecture's ``config.json`` (no ``auto_map``/``darts`` entries,
``tie_word_embeddings: false``), the tokenizer and other plain files, and the merged weights. The
weight files are hard links to ``out/``'s merged shards (the same bytes, no extra disk; ``out/`` is not
changed: ``export`` only ever renames those shards, never rewrites them). A tied merge gets one extra
small shard holding ``lm_head.weight``, a copy of the input embeddings, so every loader sees a separate
output matrix. Where a hard link is impossible (another file system) or ``copy`` is asked for, the
files are copied.
"""

import logging
import os
import shutil
from typing import Dict, List

from mergekit_darts.output import layout
from mergekit_darts.output.bake import (
    EMBED_KEY, HEAD_KEY, copy_plain_files, merged_head_source, read_merged_tensor, write_safetensors,
)
from mergekit_darts.output.layout import INDEX, SINGLE_WEIGHTS, shard_path

LOG = logging.getLogger(__name__)

README = """# Plain base of {source}

The merged model of `{source}` without remote code or surgery (`{arch}`), written by
`mergekit-darts export-peft` as the base for the adapters in the folders next to this one.
{tied}Weight files: {weights}. A hard link is the same file as the source's: anything that rewrites
that file in place (not mergekit-darts, which only renames it) changes this base too.
"""


def plain_base_config(config: dict) -> dict:
    """``config`` as the plain architecture with an LM head of its own (what ``bake`` also writes)."""
    plain = layout.plain_config(config)
    plain["tie_word_embeddings"] = False
    return plain


def _place(source: str, target: str, copy: bool) -> bool:
    """Hard-link ``source`` to ``target`` (True), or copy it when asked or when linking fails (False)."""
    if not copy:
        try:
            os.link(source, target)
            return True
        except OSError as error:  # another file system, or one without hard links
            LOG.warning("could not hard-link %s (%s); copying %.1f MB instead", source, error,
                        os.path.getsize(source) / 1e6)
    shutil.copyfile(source, target)
    return False


def write_plain_base(out_dir: str, dest: str, copy: bool = False) -> Dict[str, object]:
    """Write the plain base of ``out_dir`` into the new directory ``dest``; returns a summary
    (architecture, whether the head was untied, weight files linked / copied / written)."""
    config = layout.read_config(out_dir)
    arch = layout.plain_architecture(config)
    weight_map = layout.merged_weight_map(out_dir)
    files = sorted(set(weight_map.values()))
    untie = merged_head_source(out_dir, config) != HEAD_KEY  # tied: the checkpoint has no head of its own
    os.makedirs(dest)
    linked: List[str] = []
    copied: List[str] = []
    written: List[str] = []  # the untied head
    count = len(files) + (1 if untie else 0)
    names = ({files[0]: SINGLE_WEIGHTS} if count == 1 else
             {name: f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i, name in enumerate(files)})
    new_map = {}
    for name in files:
        source, target = shard_path(out_dir, name), os.path.join(dest, names[name])
        (linked if _place(source, target, copy) else copied).append(names[name])
        new_map.update({tensor: names[name] for tensor, f in weight_map.items() if f == name})
    if untie:
        head_file = f"model-{count:05d}-of-{count:05d}.safetensors"
        info = layout.safetensors_header(shard_path(out_dir, weight_map[EMBED_KEY]))[EMBED_KEY]
        write_safetensors(os.path.join(dest, head_file),
                          [(HEAD_KEY, info["dtype"], info["shape"], lambda: read_merged_tensor(out_dir, EMBED_KEY))])
        new_map[HEAD_KEY] = head_file
        written.append(head_file)
    if count > 1:
        total = sum(layout.tensor_bytes(layout.safetensors_header(os.path.join(dest, f))) for f in set(new_map.values()))
        layout.write_json(os.path.join(dest, INDEX),
                          {"metadata": {"total_size": total}, "weight_map": dict(sorted(new_map.items()))})
    layout.write_json(os.path.join(dest, "config.json"), plain_base_config(config))
    copy_plain_files(out_dir, dest)
    parts = [f"{len(group)} {how}" for group, how in ((linked, "hard-linked to the source's merged shards"),
                                                       (copied, "copied"), (written, "written here")) if group]
    tied = ("The source ties its LM head to the input embeddings; here `lm_head.weight` is a copy of them "
            "(`tie_word_embeddings: false`), so a LoRA on `lm_head` changes only the output matrix.\n") if untie else ""
    with open(os.path.join(dest, layout.CARD), "w", encoding="utf-8") as handle:
        handle.write(README.format(source=os.path.basename(os.path.normpath(out_dir)), arch=arch, tied=tied,
                                   weights=", ".join(parts)))
    return {"architecture": arch, "untied_head": untie, "linked": linked, "copied": copied, "written": written}
