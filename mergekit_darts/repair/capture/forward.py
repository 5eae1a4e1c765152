"""Running a loaded model forward over token ids: final-norm states (+ entropies), continuations.

``ctx`` is the run's ``CaptureContext`` (batch size, padding id, capture dtype, sizes, progress).
"""

from typing import List, Optional, Tuple

import torch
from tqdm.auto import tqdm

from mergekit_darts.repair.capture.entropy import token_entropy
from mergekit_darts.repair.capture.models import decoders, final_norm, head_weight, lm_head
from mergekit_darts.repair.capture.placement import input_device, read_weight


@torch.no_grad()
def forward_hidden(model, ids: List[List[int]], ctx, desc: str, with_entropy: bool):
    """Final-norm outputs for ``ids`` in batches: ([N, T, H] capture dtype, [N, T] float32 or None) on cpu."""
    norm, head = final_norm(model), lm_head(model)
    # read once per pass: an offloaded head would otherwise be loaded from disk for every batch
    weight = head_weight(head) if with_entropy else None
    head_bias = read_weight(head, "bias") if with_entropy else None
    device = input_device(model, ctx.device)
    # Run only the decoder when it owns the norm: the LM head's [B, T, V] logits are not needed.
    runner = next((d for d in decoders(model) if any(m is norm for m in d.modules())), model)
    captured: List[torch.Tensor] = []
    handle = norm.register_forward_hook(lambda module, args, out: captured.append(out[0] if isinstance(out, tuple) else out))
    longest = max(len(row) for row in ids)
    hidden = torch.zeros(len(ids), longest, ctx.hidden_size or head.weight.shape[1], dtype=ctx.dtype)
    entropy = torch.zeros(len(ids), longest, dtype=torch.float32) if with_entropy else None
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths batch together: less padding
    try:
        for start in tqdm(range(0, len(order), ctx.batch_size), desc=desc, disable=not ctx.progress, leave=False):
            rows = order[start:start + ctx.batch_size]
            input_ids, mask = pad_rows([ids[i] for i in rows], ctx.pad_id)
            position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
            captured.clear()
            runner(input_ids=input_ids.to(device), attention_mask=mask.long().to(device),
                   position_ids=position_ids.to(device), use_cache=False)
            states = captured[-1]
            batch_entropy = token_entropy(states, weight, head_bias) if with_entropy else None
            for j, i in enumerate(rows):
                n = len(ids[i])
                hidden[i, :n] = states[j, :n].to("cpu", ctx.dtype)
                if with_entropy:
                    entropy[i, :n] = batch_entropy[j, :n].cpu()
    finally:
        handle.remove()
    return hidden, entropy


@torch.no_grad()
def continue_prompts(model, prompts: List[List[int]], n: int, ctx, stop_ids: set, desc: str,
                     temperature: Optional[float] = None, seed: int = 0) -> List[List[int]]:
    """Each prompt + the model's greedy continuation: up to ``n`` tokens, stopping before EOS and
    at ``max_positions`` (so a continued sample is never truncated). With ``temperature`` the
    continuation is sampled (full distribution, no top-k/top-p) from torch's RNG seeded with
    ``seed``; the caller's RNG state is left as it was."""
    if temperature is None:
        return _continue_batches(model, prompts, n, ctx, stop_ids, desc, None)
    # every GPU: a model placed across devices (device_map) samples on the last one
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []):
        torch.manual_seed(seed)
        return _continue_batches(model, prompts, n, ctx, stop_ids, desc, temperature)


def _continue_batches(model, prompts, n, ctx, stop_ids, desc, temperature: Optional[float]) -> List[List[int]]:
    out: List[Optional[List[int]]] = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in tqdm(range(0, len(order), ctx.batch_size), desc=desc, disable=not ctx.progress, leave=False):
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
        generated = model.generate(
            input_ids=input_ids.to(device), attention_mask=mask.to(device),
            max_new_tokens=max(budgets), min_new_tokens=0, do_sample=temperature is not None, num_beams=1,
            # sampling is from the full distribution: no top-k/top-p from the model's generation_config
            temperature=temperature, top_p=None if temperature is None else 1.0,
            top_k=None if temperature is None else 0, pad_token_id=ctx.pad_id,
        )[:, longest:].cpu()
        for j, i in enumerate(rows):
            tokens = generated[j, :max(budgets[j], 0)].tolist()
            cut = next((k for k, token in enumerate(tokens) if token in stop_ids), len(tokens))
            out[i] = list(prompts[i]) + tokens[:cut]
    return out


def eos_ids(model) -> set:
    """The token ids a continuation stops before (generation config and model config)."""
    ids = set()
    for source in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                   getattr(model.config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(x) for x in source)
    return ids


def pad_rows(rows: List[List[int]], pad_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [N, T] ids and bool mask."""
    longest = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.bool)
    for i, row in enumerate(rows):
        input_ids[i, :len(row)] = torch.as_tensor(row, dtype=torch.long)
        mask[i, :len(row)] = True
    return input_ids, mask
