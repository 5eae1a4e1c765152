"""The demo's tiny Llama family: a word-level tokenizer, a base and one expert per domain, on CPU.

The base is pretrained briefly on a mixture of the three domains (language model loss on the whole
text); each expert is the base fully fine-tuned on its own domain only (loss on the answer tokens),
so the three task vectors pull the same weights in different directions. Everything is saved as a
safetensors Hugging Face directory that mergekit can merge. Seeds are explicit; with the same seed,
sizes and thread count the weights are bit-identical.
"""

import json
import math
import os
import shutil
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

import torch

from mergekit_darts.console import progress_bar
from mergekit_darts.tiny import build_tokenizer, tiny_config

FAMILY_VERSION = 2  # bump when the data or training changes: cached families are rebuilt
# Tiny matmuls gain nothing from threads, and on a shared 2-core machine OpenMP's spin-waiting made
# 2 threads ~50x slower than 1 (measured: 2.0 s vs 0.04 s per step); at most 2 threads in any case.
THREADS = 1


@dataclass(frozen=True)
class FamilySpec:
    hidden_size: int = 128
    layers: int = 4
    seq_len: int = 128
    batch_size: int = 32
    base_steps: int = 300
    base_lr: float = 3e-3
    expert_steps: int = 400
    expert_lr: float = 1e-3
    train_examples: int = 3000

    @classmethod
    def quick(cls) -> "FamilySpec":
        return cls(hidden_size=64, layers=2, base_steps=200, expert_steps=250, train_examples=1500)


def _encode(tokenizer, examples: List[dict], seq_len: int, answer_only: bool):
    """(ids, labels) per example: <s> prompt completion </s>; labels -100 on the prompt if asked."""
    rows = []
    for example in examples:
        prompt = tokenizer(example["prompt"])["input_ids"]
        answer = tokenizer(example["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = (prompt + answer)[:seq_len]
        labels = ([-100] * len(prompt) if answer_only else prompt) + answer
        rows.append((ids, labels[:seq_len]))
    return rows


def _batch(rows, index, pad_id):
    width = max(len(rows[i][0]) for i in index)
    ids = torch.full((len(index), width), pad_id, dtype=torch.long)
    labels = torch.full((len(index), width), -100, dtype=torch.long)
    mask = torch.zeros((len(index), width), dtype=torch.long)
    for row, i in enumerate(index):
        seq, lab = rows[i]
        ids[row, :len(seq)] = torch.tensor(seq)
        labels[row, :len(lab)] = torch.tensor(lab)
        mask[row, :len(seq)] = 1
    return ids, mask, labels


def train_lm(model, groups: List[list], steps: int, lr: float, batch_size: int, seed: int, pad_id: int,
             desc: str = "train", progress: bool = True, lines: bool = False) -> List[float]:
    """nanoGPT-style loop: AdamW, linear warmup then cosine decay, grad clip 1; returns losses.

    ``groups``: lists of encoded rows; step i draws its batch from group i % len(groups) (one
    domain per batch: similar lengths, little padding). Right padding and a causal mask need no
    attention mask: real tokens never see the pads after them, and pads carry no loss. ``progress``:
    a tqdm bar; ``lines``: a line every few seconds instead (stderr is a log file).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return _train(model, groups, steps, lr, batch_size, seed, pad_id, desc, progress, lines)
    finally:
        torch.set_num_threads(threads)


def _train(model, groups, steps, lr, batch_size, seed, pad_id, desc, progress, lines):
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 10)
    model.train()
    losses = []
    bar = progress_bar(steps, desc, bars=progress, lines=lines, unit="steps")
    for step in range(steps):
        scale = (step + 1) / warmup if step < warmup else 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
        for group in optimizer.param_groups:
            group["lr"] = lr * scale
        rows = groups[step % len(groups)]
        index = torch.randint(len(rows), (batch_size,), generator=generator).tolist()
        ids, _, labels = _batch(rows, index, pad_id)
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % 20 == 0:
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        bar.update(1)
    bar.close()
    model.eval()
    return losses


def _save(model, tokenizer, path: str) -> None:
    from transformers.utils import logging as hf_logging

    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # transformers' "Writing model shards" bar of a tiny model says nothing
    try:
        model.save_pretrained(tmp, safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def build_family(root: str, splits: Dict[str, Dict[str, List[dict]]], words: List[str], seed: int = 0,
                 spec: Optional[FamilySpec] = None, progress: bool = True, log=print,
                 lines: bool = False) -> Dict[str, str]:
    """Train (or reuse from ``root``) the tokenizer, base and experts; returns {"base"|domain: path}.

    A ``family.json`` stamp (seed, spec, version, vocabulary) decides whether a cached family is
    reused; it is written last, so an interrupted build is redone.
    """
    from transformers import AutoModelForCausalLM

    spec = spec or FamilySpec()
    domains = list(splits)
    paths = {"base": os.path.join(root, "base"), **{d: os.path.join(root, d) for d in domains}}
    stamp = {"version": FAMILY_VERSION, "seed": seed, "spec": asdict(spec), "domains": domains,
             "vocab": len(words), "vocab_hash": hash_words(words)}
    stamp_path = os.path.join(root, "family.json")
    if os.path.exists(stamp_path) and all(os.path.isdir(p) for p in paths.values()):
        with open(stamp_path) as f:
            previous = json.load(f)
        if {k: v for k, v in previous.items() if k != "losses"} == stamp:
            log(f"reusing the model family in {root}")
            return paths
    os.makedirs(root, exist_ok=True)
    if os.path.exists(stamp_path):
        os.remove(stamp_path)

    # the longest silent stage of the demo otherwise: say what it does before it starts
    log(f"training the model family in {root}: a base ({spec.base_steps} steps on the mixture), then "
        f"{len(domains)} experts ({spec.expert_steps} steps each)")
    tokenizer = build_tokenizer(words, chat_template=False)
    config = tiny_config("llama", vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
                         layers=spec.layers, max_position_embeddings=spec.seq_len)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id

    mixture = [_encode(tokenizer, splits[d]["train"], spec.seq_len, answer_only=False) for d in domains]
    losses = {"base": train_lm(model, mixture, spec.base_steps, spec.base_lr, spec.batch_size, seed,
                               tokenizer.pad_token_id, desc="pretrain base", progress=progress, lines=lines)}
    _save(model, tokenizer, paths["base"])
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    for index, domain in enumerate(domains):
        model.load_state_dict(base_state)
        rows = _encode(tokenizer, splits[domain]["train"], spec.seq_len, answer_only=True)
        losses[domain] = train_lm(model, [rows], spec.expert_steps, spec.expert_lr, spec.batch_size,
                                  seed + 1 + index, tokenizer.pad_token_id, desc=f"fine-tune {domain}",
                                  progress=progress, lines=lines)
        _save(model, tokenizer, paths[domain])
    with open(stamp_path, "w") as f:
        json.dump({**stamp, "losses": {k: [v[0], v[-1]] if v else [] for k, v in losses.items()}}, f, indent=1)
    log("trained the family: " + ", ".join(f"{k} loss {v[0]:.2f} -> {v[-1]:.2f}" for k, v in losses.items() if v))
    return paths


def hash_words(words: List[str]) -> str:
    import hashlib

    return hashlib.sha256("\n".join(words).encode()).hexdigest()[:16]
