"""What the report measures about generation (docs/quality.md, "Behaviour"): on held-out prompts, does
the model write what the expert writes?

The held-out records of a domain with ``continue_tokens > 0`` hold each prompt followed by the
expert's greedy continuation (at most ``continue_tokens`` tokens, stopped before EOS). Greedy decoding
from another model repeats that continuation token for token up to the first position where its
top-1 token differs from the expert's: until then both models see the same context. So the model's
top-1 token at every position of the expert's continuation (teacher forced, from the cached states)
gives, without generating anything:

- ``exact_match``: the share of prompts whose greedy continuation equals the expert's exactly (every
  token, and the stop: where the expert stopped before the budget, the model's top-1 there must be
  a stop token too: any stop id of the expert or the merge (their config's and generation_config.json's
  eos ids, ``CapturedDomain.stop_ids``), which ``generate`` stops on alike — a Llama-3 model stopping on
  ``<|end_of_text|>`` where the expert wrote ``<|eot_id|>`` stops all the same);
- ``top1_agreement``: the mean over prompts of the share of the expert's decisions (its tokens, and its
  stop) that are also the model's top-1 token, along the expert's own continuation;
- ``first_disagreement``: the mean over prompts of the position (0-based, in continuation tokens) of
  the first token the model's greedy continuation gets wrong; an exact match counts as its length.

``before`` is the plain merge, ``after`` the corrected model. ``tests/test_behaviour.py`` checks the
figures against real ``generate`` calls of the exported model and the expert.

A held-out record that leaves less room than ``continue_tokens`` under ``max_positions`` (a document)
is measured on its prefix instead: the capture cut it to ``max_positions - continue_tokens`` tokens
and continued that (``CapturedDomain.prefixes``, capture/prefixes.py). A prompt the expert ends at
once is left out and counted (``empty_continuations``); fewer than ``MIN_BEHAVIOUR_PROMPTS`` prompts
left and the figures are ``not_measured``, with the counts and the reason.
"""

from typing import Any, Dict, List, Optional, Sequence

import torch

# Fewer prompts with a continuation than this, and the figures are no score: ``not_measured`` with the
# counts (docs/quality.md, "Behaviour"). With 5 prompts exact match moves in steps of 0.2 already.
MIN_BEHAVIOUR_PROMPTS = 5


def decision_positions(prompt_length: int, length: int, budget: int) -> List[int]:
    """Positions whose top-1 token is one of the expert's decisions: each position before one of its
    continuation tokens, and the last position when it stopped before the budget (its stop token)."""
    positions = list(range(max(prompt_length - 1, 0), length - 1))
    if length - prompt_length < budget:
        positions.append(length - 1)
    return positions if prompt_length > 0 else []


@torch.no_grad()
def _top1(states: torch.Tensor, head: torch.Tensor, chunk_size: int, correction=None) -> torch.Tensor:
    """argmax over the vocabulary of ``states @ head.T`` (+ ``correction(states)``), in chunks of rows."""
    picks = []
    for start in range(0, states.shape[0], chunk_size):
        part = states[start:start + chunk_size].float()
        logits = part @ head.float().T
        if correction is not None:
            logits = logits + correction(part)
        picks.append(logits.argmax(dim=-1))
    return torch.cat(picks) if picks else torch.zeros(0, dtype=torch.long, device=states.device)


def _figures(agree: List[torch.Tensor], lengths: List[int]) -> Dict[str, float]:
    exact = [bool(a.all()) for a in agree]
    first = [int(torch.nonzero(~a)[0]) if not bool(a.all()) else n for a, n in zip(agree, lengths)]
    return {"exact_match": sum(exact) / len(agree),
            "top1_agreement": sum(float(a.float().mean()) for a in agree) / len(agree),
            "first_disagreement": sum(first) / len(agree)}


@torch.no_grad()
def held_out_behaviour(input_ids: torch.Tensor, mask: torch.Tensor, prompt_lengths: torch.Tensor,
                       merged: torch.Tensor, corrected: torch.Tensor, expert: torch.Tensor,
                       merged_head: torch.Tensor, expert_head: torch.Tensor, budget: int, max_positions: int,
                       head_correction=None, chunk_size: int = 1024,
                       stop_ids: Optional[Sequence[int]] = None) -> Optional[Dict[str, Any]]:
    """Greedy-generation agreement with the expert on held-out records, plain merge vs corrected.

    input_ids / mask: [N, T] (prompt + the expert's greedy continuation, right padded); prompt_lengths:
    [N]; merged / corrected / expert: [N, T, H] final states (the corrected ones before the head
    correction, which ``head_correction`` adds to the logits); ``budget``: ``continue_tokens``;
    ``stop_ids``: every token that ends a continuation (where the expert stopped, a model whose top-1 is
    any of them stops too); None: only the expert's own top-1 token there counts as its stop.
    A prompt the expert ended at once (no token written) is left out of the figures and counted in
    ``empty_continuations``; with none left, the result has the counts and no ``before`` / ``after``.
    None when no record has room for a continuation (``budget`` 0, or every prompt at max_positions)."""
    lengths = mask.sum(dim=1).tolist()
    rows, positions, final_rows, empty = [], [], [], 0
    for i, (p, n) in enumerate(zip(prompt_lengths.tolist(), lengths)):
        row_budget = max(0, min(budget, max_positions - p))
        if row_budget <= 0 or p <= 0:
            continue
        if n == p:  # the expert wrote nothing: its one decision (stop at once) is no continuation to match
            empty += 1
            continue
        where = decision_positions(p, n, row_budget)
        rows.append((i, len(positions), len(where), n - p))
        positions += [(i, t) for t in where]
        if n - p < row_budget:  # the expert stopped: its last decision is the stop token
            final_rows.append(len(positions) - 1)
    if not rows and not empty:
        return None
    result: Dict[str, Any] = {"prompts": len(rows), "empty_continuations": empty, "budget": budget}
    if not rows:
        return result
    device = merged.device
    index_rows = torch.tensor([i for i, _ in positions], device=device)
    index_cols = torch.tensor([t for _, t in positions], device=device)
    # the expert's decision at each position: its next token, or (at a stop) its own top-1 token there
    targets = input_ids.to(device)[index_rows, (index_cols + 1).clamp(max=input_ids.shape[1] - 1)].clone()
    final = torch.tensor(final_rows, dtype=torch.long, device=device)
    stops = None if stop_ids is None else torch.tensor(sorted(set(int(i) for i in stop_ids)), dtype=torch.long,
                                                       device=device)
    if final_rows and stops is None:
        targets[final] = _top1(expert[index_rows[final], index_cols[final]], expert_head, chunk_size)
    result.update({"expert_tokens": sum(length for *_, length in rows) / len(rows),
                   "stopped_before_budget": len(final_rows) / len(rows)})
    for label, states, correction in (("before", merged, None), ("after", corrected, head_correction)):
        picks = _top1(states.to(device)[index_rows, index_cols], merged_head, chunk_size, correction)
        agree = picks == targets
        if stops is not None and final_rows:  # the decision there is "stop": any stop id makes it
            agree[final] = torch.isin(picks[final], stops)
        result[label] = _figures([agree[start:start + count] for _, start, count, _ in rows],
                                 [length for *_, length in rows])
    return result


def not_measured(reason: str, **counts) -> Dict[str, Any]:
    return {"not_measured": reason, **counts}


def judged(measured: Optional[Dict[str, Any]], min_prompts: int = MIN_BEHAVIOUR_PROMPTS) -> Dict[str, Any]:
    """``held_out_behaviour``'s result as the report shows it: figures taken on fewer than
    ``min_prompts`` prompts with a continuation are no score; they become ``not_measured`` with the
    reason, and the counts stay beside it."""
    if measured is None:
        return not_measured("no held-out prompt leaves room for a continuation under max_positions, and no prefix "
                            "of one was captured (continue_tokens must be below max_positions)")
    prompts, empty = measured["prompts"], measured["empty_continuations"]
    if prompts >= min_prompts:
        return measured
    counts = {key: value for key, value in measured.items() if key not in ("before", "after")}
    if prompts == 0:
        return not_measured(f"the expert ends every held-out prompt at once ({empty} of {empty}: no token "
                            "written), so there is no continuation to compare with", **counts)
    ended = f" (the expert ended {empty} more at once)" if empty else ""
    return not_measured(f"only {prompts} held-out prompt(s) with a continuation{ended}, fewer than the "
                        f"{min_prompts} a figure needs: hold out more records (surgery.held_out) or give more "
                        "calibration records", **counts)


def _padded(tensors: List[torch.Tensor], length: int) -> torch.Tensor:
    """Rows of ``tensors`` ([n, T_i, ...]) right padded with zeros to ``length`` and stacked."""
    out = []
    for tensor in tensors:
        pad = [0, 0] * (tensor.dim() - 2) + [0, length - tensor.shape[1]]
        out.append(torch.nn.functional.pad(tensor, pad))
    return torch.cat(out)


def measured_rows(data, rows: torch.Tensor, corrected: torch.Tensor, prefix_corrected: Optional[torch.Tensor]):
    """(input_ids, mask, prompt_lengths, merged, corrected, expert, prefixes used) of the held-out records
    ``rows``: each on its own row, or, when the capture cut a prefix of it (``data.prefixes``), on its
    prefix row, whose ``prefix_corrected`` states the caller computed."""
    parts = [(data.input_ids[rows], data.attention_mask[rows], data.prompt_lengths[rows],
              data.merged_hidden[rows].float(), corrected.float(), data.expert_hidden[rows].float())]
    prefixes, records = getattr(data, "prefixes", None), getattr(data, "prefix_records", None)
    used = 0
    if prefixes is not None and prefix_corrected is not None:
        take = torch.isin(records, rows)
        keep = ~torch.isin(rows, records[take])
        used = int(take.sum())
        own = parts[0]
        parts = [tuple(tensor[keep] for tensor in own),
                 (prefixes.input_ids[take], prefixes.attention_mask[take], prefixes.prompt_lengths[take],
                  prefixes.merged_hidden[take].float(), prefix_corrected[take].float(),
                  prefixes.expert_hidden[take].float())]
    length = max(part[0].shape[1] for part in parts)
    joined = []
    for k in range(6):
        tensors = [part[k] for part in parts]
        joined.append(torch.cat(tensors) if k == 2 else _padded(tensors, length))
    return (*joined, used)


def domain_behaviour(data, rows: torch.Tensor, corrected: torch.Tensor, module, merged_head: torch.Tensor,
                     continue_tokens: int, max_positions: int, chunk_size: int,
                     prefix_corrected: Optional[torch.Tensor] = None) -> Dict[str, Any]:
    """``held_out_behaviour`` of a captured domain's records ``rows`` (its report entry's "behaviour"),
    judged against ``MIN_BEHAVIOUR_PROMPTS``; ``prefix_corrected``: the corrected states of
    ``data.prefixes`` (the held-out records cut to leave room for a continuation)."""
    if continue_tokens <= 0:
        return not_measured("calibration.continue_tokens is 0: the records hold no expert continuation to "
                            "compare with; set continue_tokens (e.g. the generation length you evaluate with)")
    if getattr(data, "prompt_lengths", None) is None:
        return not_measured("the capture has no prompt lengths")
    head = module.head_correction if module.head_rank > 0 else None
    input_ids, mask, prompt_lengths, merged, after, expert, used = measured_rows(data, rows, corrected,
                                                                                 prefix_corrected)
    measured = held_out_behaviour(input_ids, mask, prompt_lengths, merged, after, expert, merged_head.float(),
                                  data.expert_head.float(), budget=continue_tokens, max_positions=max_positions,
                                  head_correction=head, chunk_size=chunk_size,
                                  stop_ids=getattr(data, "stop_ids", None))
    if measured is not None:
        measured["prefixes"] = used  # held-out records measured on a prefix (before leaving out empty ones)
    return judged(measured)
