"""Running a loaded model forward over token ids: final-norm states (+ entropies, + a block's input),
and the expert's own continuations.

``ctx`` is the run's ``CaptureContext`` (batch size, padding id, capture dtype, sizes, progress).
Continuations are plain greedy (or seeded samples from the full distribution when the config asks):
the expert's own ``generation_config.json`` sampling and penalty settings are not applied, so what
was generated is exactly what the cache key says (``generation_settings``).
"""

import contextlib
import os
from typing import Dict, List, Optional, Tuple

import torch

from mergekit_darts.console import progress_iter
from mergekit_darts.repair.capture.entropy import entropy_head, token_entropy
from mergekit_darts.repair.capture.models import decoders, final_norm, head_weight, lm_head, release_freed_memory
from mergekit_darts.repair.capture.placement import input_device, read_weight


@torch.no_grad()
def forward_hidden(model, ids: List[List[int]], ctx, desc: str, with_entropy: bool,
                   block_index: Optional[int] = None):
    """Final-norm outputs for ``ids`` in batches, on the cpu: ([N, T, H] capture dtype, [N, T] float32
    entropies or None, [N, T, H] float32 input of decoder layer ``block_index`` or None), zero at padding."""
    norm, head = final_norm(model), lm_head(model)
    device = input_device(model, ctx.device)
    # Run only the decoder when it owns the norm: the LM head's [B, T, V] logits are not needed.
    runner = next((d for d in decoders(model) if any(m is norm for m in d.modules())), model)
    captured: List[torch.Tensor] = []
    seen: List[torch.Tensor] = []
    handles = [norm.register_forward_hook(lambda module, args, out: captured.append(out[0] if isinstance(out, tuple) else out))]
    if block_index is not None:
        handles.append(model.model.layers[block_index].register_forward_pre_hook(
            lambda module, args, kwargs: seen.append(args[0] if args else kwargs["hidden_states"]), with_kwargs=True))
    longest = max(len(row) for row in ids)
    hidden = torch.zeros(len(ids), longest, ctx.hidden_size or head.weight.shape[1], dtype=ctx.dtype)
    entropy = torch.zeros(len(ids), longest, dtype=torch.float32) if with_entropy else None
    blocks = torch.zeros(hidden.shape, dtype=torch.float32) if block_index is not None else None
    weight = bias = None  # the head as the entropy needs it, made once per pass (not per batch) where the states are
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths batch together: less padding
    try:
        for start in progress_iter(range(0, len(order), ctx.batch_size), desc, bars=ctx.progress, lines=ctx.lines,
                                   unit="batches"):
            rows = order[start:start + ctx.batch_size]
            input_ids, mask = pad_rows([ids[i] for i in rows], ctx.pad_id)
            position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
            captured.clear()
            seen.clear()
            runner(input_ids=input_ids.to(device), attention_mask=mask.long().to(device),
                   position_ids=position_ids.to(device), use_cache=False)
            states = captured[-1]
            # one copy off the device per batch and tensor, then rows are placed on the cpu
            parts = [(hidden, states.to("cpu", ctx.dtype))]
            if with_entropy:
                if weight is None:
                    weight = entropy_head(head_weight(head), states.device)
                    bias = read_weight(head, "bias")
                    bias = None if bias is None else bias.to(states.device, torch.float32)
                parts.append((entropy, token_entropy(states, weight, bias).cpu()))
            if blocks is not None:
                parts.append((blocks, seen[-1].to("cpu", torch.float32)))
            del states
            for j, i in enumerate(rows):
                n = len(ids[i])
                for out, batch in parts:
                    out[i, :n] = batch[j, :n]
            del parts
            release_freed_memory()  # the batch's activations: not kept mapped under the next batch
    finally:
        for handle in handles:
            handle.remove()
    del weight, bias
    release_freed_memory()
    return hidden, entropy, blocks


def stop_ids(model_dir: str, trust_remote_code: bool = False) -> List[int]:
    """The token ids a continuation stops before: the EOS ids of the model's config and of its
    ``generation_config.json`` (read from the files, so the cache key knows them before any load)."""
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    sources = [getattr(config, "eos_token_id", None)]
    if os.path.isfile(os.path.join(model_dir, "generation_config.json")):
        sources.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    ids = set()
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(x) for x in source)
    return sorted(ids)


def generation_settings(new_tokens: int, ctx, stop: List[int], samples: int = 0, temperature: float = 1.0,
                        seed: int = 0) -> Dict:
    """Everything that decides a continuation, as used (part of the cache key)."""
    settings = {"decoding": "greedy", "max_new_tokens": new_tokens, "max_positions": ctx.max_positions,
                "stop_ids": list(stop), "pad_id": ctx.pad_id, "repetition_penalty": 1.0}
    if samples:
        settings["samples"] = {"count": samples, "temperature": temperature, "seed": seed, "top_k": 0, "top_p": 1.0}
    return settings


@contextlib.contextmanager
def plain_generation_config(model):
    """``model.generation_config`` replaced by the library defaults while generating: ``generate``
    fills every setting the call does not pass (repetition_penalty, top_k, no_repeat_ngram_size, ...)
    from it, so the expert's own generation_config.json would otherwise change the continuation."""
    from transformers import GenerationConfig

    if not hasattr(model, "generation_config"):  # not a transformers model: nothing to replace
        yield
        return
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


@torch.no_grad()
def continue_prompts(model, prompts: List[List[int]], n: int, ctx, stop: List[int], desc: str,
                     temperature: Optional[float] = None, seed: int = 0) -> List[List[int]]:
    """Each prompt + the model's greedy continuation: up to ``n`` tokens, stopping before a ``stop``
    id and at ``max_positions`` (so a continued sample is never truncated). With ``temperature`` the
    continuation is sampled (full distribution, no top-k/top-p) from torch's RNG seeded with
    ``seed``; the caller's RNG state is left as it was."""
    with plain_generation_config(model):
        if temperature is None:
            return _continue_batches(model, prompts, n, ctx, stop, desc, None)
        # every GPU: a model placed across devices (device_map) samples on the last one
        with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []):
            torch.manual_seed(seed)
            return _continue_batches(model, prompts, n, ctx, stop, desc, temperature)


def _continue_batches(model, prompts, n, ctx, stop, desc, temperature: Optional[float]) -> List[List[int]]:
    out: List[Optional[List[int]]] = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in progress_iter(range(0, len(order), ctx.batch_size), desc, bars=ctx.progress, lines=ctx.lines,
                               unit="batches"):
        rows = order[start:start + ctx.batch_size]
        budgets = [min(n, ctx.max_positions - len(prompts[i])) for i in rows]
        if max(budgets) <= 0:
            for i in rows:
                out[i] = list(prompts[i])
            continue
        # Left padding for generation: every row's next token is then at the same column.
        longest = max(len(prompts[i]) for i in rows)
        input_ids = torch.full((len(rows), longest), ctx.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for j, i in enumerate(rows):
            input_ids[j, longest - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[j, longest - len(prompts[i]):] = 1
        device = input_device(model, ctx.device)
        sampled = temperature is not None
        generated = model.generate(
            input_ids=input_ids.to(device), attention_mask=mask.to(device),
            max_new_tokens=max(budgets), min_new_tokens=0, do_sample=sampled, num_beams=1,
            temperature=temperature if sampled else 1.0, top_p=1.0, top_k=0 if sampled else None,
            repetition_penalty=1.0, pad_token_id=ctx.pad_id, eos_token_id=list(stop) or None,
        )[:, longest:].cpu()
        for j, i in enumerate(rows):
            tokens = generated[j, :max(budgets[j], 0)].tolist()
            cut = next((k for k, token in enumerate(tokens) if token in stop), len(tokens))
            out[i] = list(prompts[i]) + tokens[:cut]
    return out


def pad_rows(rows: List[List[int]], pad_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [N, T] ids and bool mask."""
    longest = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.bool)
    for i, row in enumerate(rows):
        input_ids[i, :len(row)] = torch.as_tensor(row, dtype=torch.long)
        mask[i, :len(row)] = True
    return input_ids, mask
