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
  the expert's stop token too);
- ``top1_agreement``: the mean over prompts of the share of the expert's decisions (its tokens, and its
  stop) that are also the model's top-1 token, along the expert's own continuation;
- ``first_disagreement``: the mean over prompts of the position (0-based, in continuation tokens) of
  the first token the model's greedy continuation gets wrong; an exact match counts as its length.

``before`` is the plain merge, ``after`` the corrected model. ``tests/test_behaviour.py`` checks the
figures against real ``generate`` calls of the exported model and the expert.
"""

from typing import Any, Dict, List, Optional

import torch


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
                       head_correction=None, chunk_size: int = 1024) -> Optional[Dict[str, Any]]:
    """Greedy-generation agreement with the expert on held-out records, plain merge vs corrected.

    input_ids / mask: [N, T] (prompt + the expert's greedy continuation, right padded); prompt_lengths:
    [N]; merged / corrected / expert: [N, T, H] final states (the corrected ones before the head
    correction, which ``head_correction`` adds to the logits); ``budget``: ``continue_tokens``.
    None when no record has a decision to compare (``budget`` 0, or every prompt at max_positions)."""
    lengths = mask.sum(dim=1).tolist()
    rows, positions, final_rows = [], [], []
    for i, (p, n) in enumerate(zip(prompt_lengths.tolist(), lengths)):
        row_budget = max(0, min(budget, max_positions - p))
        where = decision_positions(p, n, row_budget) if row_budget > 0 else []
        if where:
            rows.append((i, len(positions), len(where), n - p))
            positions += [(i, t) for t in where]
            if n - p < row_budget:  # the expert stopped: its last decision is the stop token
                final_rows.append(len(positions) - 1)
    if not rows:
        return None
    device = merged.device
    index_rows = torch.tensor([i for i, _ in positions], device=device)
    index_cols = torch.tensor([t for _, t in positions], device=device)
    # the expert's decision at each position: its next token, or (at a stop) its own top-1 token there
    targets = input_ids.to(device)[index_rows, (index_cols + 1).clamp(max=input_ids.shape[1] - 1)].clone()
    if final_rows:
        final = torch.tensor(final_rows, device=device)
        targets[final] = _top1(expert[index_rows[final], index_cols[final]], expert_head, chunk_size)
    result: Dict[str, Any] = {"prompts": len(rows), "budget": budget,
                              "expert_tokens": sum(length for *_, length in rows) / len(rows),
                              "stopped_before_budget": len(final_rows) / len(rows)}
    for label, states, correction in (("before", merged, None), ("after", corrected, head_correction)):
        picks = _top1(states.to(device)[index_rows, index_cols], merged_head, chunk_size, correction)
        agree = picks == targets
        result[label] = _figures([agree[start:start + count] for _, start, count, _ in rows],
                                 [length for *_, length in rows])
    return result


def not_measured(reason: str) -> Dict[str, str]:
    return {"not_measured": reason}


def domain_behaviour(data, rows: torch.Tensor, corrected: torch.Tensor, module, merged_head: torch.Tensor,
                     continue_tokens: int, max_positions: int, chunk_size: int) -> Dict[str, Any]:
    """``held_out_behaviour`` of a captured domain's records ``rows`` (its report entry's "behaviour")."""
    if continue_tokens <= 0:
        return not_measured("calibration.continue_tokens is 0: the records hold no expert continuation to "
                            "compare with; set continue_tokens (e.g. the generation length you evaluate with)")
    if getattr(data, "prompt_lengths", None) is None:
        return not_measured("the capture has no prompt lengths")
    head = module.head_correction if module.head_rank > 0 else None
    measured = held_out_behaviour(
        data.input_ids[rows], data.attention_mask[rows], data.prompt_lengths[rows], data.merged_hidden[rows].float(),
        corrected.float(), data.expert_hidden[rows].float(), merged_head.float(), data.expert_head.float(),
        budget=continue_tokens, max_positions=max_positions, head_correction=head, chunk_size=chunk_size)
    return measured or not_measured("no held-out prompt leaves room for a continuation (max_positions)")
