"""Pooled states of prompt *prefixes* for the domain router (docs/routing.md, "Training").

At prefill the emitted model routes on whatever prompt it is given, and chat traffic is mostly short
prompts. A calibration record is a whole document or prompt, so the router is trained and measured
on the pooled states of its first ``l`` tokens: ``normalize(mean_{t < l} h_t)``, the shipped pooling
(``remote_code.routing.pool_prompt_states``) applied to the record cut after ``l`` tokens. Causal
attention makes the states of those tokens the same as the cut prompt's own, so nothing is run again:
a running sum over the captured states gives every prefix at once.

Chat prompts all start with the same template (a system prompt, the user header): tokens that say
nothing about the domain and that every real prompt has. Prefix lengths count the tokens *after*
that shared start (``shared_prefix_length``): "16 tokens" is a 16-token user turn, not a cut inside
the system prompt, which no real prompt is and which would teach the gate that any prompt may look
like bare template (on SmolLM2 it then sent no everyday request to ``none``; docs/routing.md).
"""

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch

# Prefix lengths the router is measured (and its gate calibrated) at; None = the whole prompt.
PREFIX_LENGTHS: Tuple[Optional[int], ...] = (16, 32, 64, None)
SHORTEST_PREFIX = 4  # random training prefixes start here ("a few tokens")
TRAIN_PREFIXES = 8  # random prefixes per training record, besides the whole record


def prefix_label(length: Optional[int]) -> str:
    return "all" if length is None else str(length)


@dataclass
class PromptStates:
    """One domain's captured prompt states, kept per record so any prefix can be pooled."""

    hidden: torch.Tensor  # [N, T, H] states where the emitted model routes (zero past each row's end)
    lengths: torch.Tensor  # [N] long: prompt tokens of each record (a continuation is not prompt)

    def __post_init__(self):
        if self.hidden.dim() != 3 or self.lengths.shape != (self.hidden.shape[0],):
            raise ValueError(f"PromptStates: hidden [N, T, H] and lengths [N], got {tuple(self.hidden.shape)} "
                             f"and {tuple(self.lengths.shape)}")
        self.lengths = self.lengths.clamp(max=self.hidden.shape[1])

    @property
    def records(self) -> int:
        return int(self.hidden.shape[0])

    def subset(self, rows: torch.Tensor) -> "PromptStates":
        return PromptStates(self.hidden[rows], self.lengths[rows])


def shared_prefix_length(states: Sequence[PromptStates], tolerance: float = 1e-2) -> int:
    """Leading positions at which every record of every domain has the same state (up to
    ``tolerance`` of its norm: batched kernels differ in the last bits), kept below the shortest
    prompt so every record has a token of its own. Causal attention makes that the shared template."""
    present = [s for s in states if s.records]
    if not present:
        return 0
    shortest = int(min(int(s.lengths.min()) for s in present))
    reference = present[0].hidden[0, :shortest].float()  # [L, H]
    scale = reference.norm(dim=-1).clamp_min(1e-6)
    same = torch.ones(shortest, dtype=torch.bool)
    for s in present:
        gap = (s.hidden[:, :shortest].float() - reference).norm(dim=-1).amax(dim=0)  # [L]
        same &= gap <= tolerance * scale
    differs = torch.nonzero(~same).flatten()
    shared = int(differs[0]) if differs.numel() else shortest
    return max(0, min(shared, shortest - 1))


def pool_prefixes(states: PromptStates, rows: torch.Tensor, lengths: torch.Tensor,
                  batch_size: int = 64) -> torch.Tensor:
    """[M, H] float32 unit vectors: record ``rows[i]`` pooled over its first ``lengths[i]`` tokens."""
    if rows.numel() == 0:
        return torch.zeros(0, states.hidden.shape[-1])
    out = torch.empty(rows.numel(), states.hidden.shape[-1])
    order = torch.argsort(rows, stable=True)
    rows, lengths = rows[order], lengths[order].clamp_min(1)
    unique = torch.unique(rows)
    for start in range(0, unique.numel(), batch_size):
        chunk = unique[start:start + batch_size]
        running = states.hidden[chunk].float().cumsum(dim=1)  # [b, T, H]
        picked = torch.isin(rows, chunk)
        local = torch.searchsorted(chunk, rows[picked])
        sums = running[local, lengths[picked] - 1]
        out[order[picked]] = torch.nn.functional.normalize(sums / lengths[picked].unsqueeze(1).float(), dim=-1)
    return out


def training_prefixes(states: PromptStates, generator: torch.Generator, count: int = TRAIN_PREFIXES,
                      shortest: int = SHORTEST_PREFIX, shared: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """(rows, lengths): every record whole, plus ``count`` random prefixes of it: ``shared`` template
    tokens and then a number drawn log-uniformly from [shortest, the rest of the record] (short
    prompts change fastest as they grow)."""
    rows, lengths = [torch.arange(states.records)], [states.lengths]
    if count > 0 and states.records:
        full = (states.lengths - shared).float().clamp_min(1)
        low = torch.minimum(torch.full_like(full, float(shortest)), full)
        draw = torch.rand(states.records, count, generator=generator)
        drawn = torch.exp(low.log().unsqueeze(1) + draw * (full.log() - low.log()).unsqueeze(1))
        rows.append(torch.arange(states.records).repeat_interleave(count))
        lengths.append(shared + drawn.round().long().clamp(min=1).flatten())
    return torch.cat(rows), torch.minimum(torch.cat(lengths), states.lengths[torch.cat(rows)])


def measured_prefixes(states: PromptStates, prefix_lengths: Sequence[Optional[int]] = PREFIX_LENGTHS,
                      shared: int = 0) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """{label: (rows, lengths)}: each record cut to ``shared`` + each measured length (a shorter
    record whole)."""
    rows = torch.arange(states.records)
    return {prefix_label(n): (rows, states.lengths if n is None else states.lengths.clamp(max=shared + n))
            for n in prefix_lengths}


def pooled_at(states: PromptStates, prefix_lengths: Sequence[Optional[int]] = PREFIX_LENGTHS, shared: int = 0
              ) -> Dict[str, torch.Tensor]:
    """{label: [N, H]} every record pooled at each measured prefix length (after ``shared`` tokens)."""
    return {label: pool_prefixes(states, rows, lengths)
            for label, (rows, lengths) in measured_prefixes(states, prefix_lengths, shared).items()}
