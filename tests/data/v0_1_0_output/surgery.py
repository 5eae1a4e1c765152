"""Representation-surgery correction modules (DESIGN §3).

This file imports torch only: it is copied next to ``modeling_darts.py`` into every output
directory, so the package and the published model share exactly one implementation of the math.
"""

from typing import Optional

import torch
from torch import nn

METHODS = ("darts", "standard")


class DomainSurgery(nn.Module):
    """One domain's correction: ``h_hat = h - up(relu(down(h))) - position_bias[pos]``.

    ``method="standard"`` is Yang et al. (2024): content correction only. ``method="darts"`` adds a
    free per-position bias table of ``max_positions`` rows; positions at or beyond ``max_positions``
    get no position correction. With ``head_rank > 0`` the module also carries a logit-space
    correction ``head_up(head_down(h_hat))`` that the caller adds to the LM head's logits.

    ``up``, ``position_bias`` and ``head_up`` start at zero, so an untrained module is the identity.
    The math runs in float32 whatever the input dtype; the output has the input's dtype.
    """

    def __init__(
        self,
        hidden_size: int,
        rank: int = 16,
        max_positions: int = 512,
        method: str = "darts",
        head_rank: int = 0,
        vocab_size: Optional[int] = None,
    ):
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"method: unknown surgery method {method!r}; choose one of {METHODS}")
        for name, value in (("hidden_size", hidden_size), ("rank", rank), ("max_positions", max_positions)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if not isinstance(head_rank, int) or head_rank < 0:
            raise ValueError(f"head_rank: must be an integer >= 0, got {head_rank!r}")
        if head_rank > 0 and (not isinstance(vocab_size, int) or vocab_size <= 0):
            raise ValueError("vocab_size: a positive vocabulary size is required when head_rank > 0")
        self.hidden_size = hidden_size
        self.rank = rank
        self.max_positions = max_positions
        self.method = method
        self.head_rank = head_rank
        self.vocab_size = vocab_size

        self.down = nn.Linear(hidden_size, rank, bias=False)
        self.up = nn.Linear(rank, hidden_size, bias=False)
        if method == "darts":
            self.position_bias = nn.Parameter(torch.zeros(max_positions, hidden_size))
        else:
            self.register_parameter("position_bias", None)
        if head_rank > 0:
            self.head_down = nn.Linear(hidden_size, head_rank, bias=False)
            self.head_up = nn.Linear(head_rank, vocab_size, bias=False)
        else:
            self.head_down = None
            self.head_up = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # down keeps nn.Linear's default (kaiming_uniform, a=sqrt(5)); everything that is added
        # to the merged model's computation starts at zero so the untrained module is the identity.
        self.down.reset_parameters()
        nn.init.zeros_(self.up.weight)
        if self.position_bias is not None:
            self.position_bias.zero_()
        if self.head_down is not None:
            self.head_down.reset_parameters()
            nn.init.zeros_(self.head_up.weight)

    def content(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """c(h) = up(ReLU(down(h))) in float32: the content part that gets subtracted."""
        h = hidden_states.float()
        return nn.functional.linear(
            torch.relu(nn.functional.linear(h, self.down.weight.float())), self.up.weight.float()
        )

    def position_correction(self, position_ids: torch.Tensor) -> torch.Tensor:
        """b[pos] in float32, zero for positions outside [0, max_positions)."""
        bias = self.position_bias.float()
        valid = (position_ids >= 0) & (position_ids < self.max_positions)
        rows = bias[position_ids.clamp(0, self.max_positions - 1).long()]
        return rows * valid.unsqueeze(-1).to(rows.dtype)

    def forward(self, hidden_states: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if hidden_states.dim() < 2 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states: expected [..., {self.hidden_size}], got {tuple(hidden_states.shape)}"
            )
        h = hidden_states.float()
        corrected = h - self.content(h)
        if self.position_bias is not None:
            if position_ids is None:
                raise ValueError("position_ids: required for method 'darts'")
            if tuple(position_ids.shape) != tuple(hidden_states.shape[:-1]):
                raise ValueError(
                    f"position_ids: shape {tuple(position_ids.shape)} does not match hidden_states "
                    f"{tuple(hidden_states.shape[:-1])}"
                )
            corrected = corrected - self.position_correction(position_ids.to(h.device))
        return corrected.to(hidden_states.dtype)

    def head_correction(self, corrected_hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """Logit-space correction U(V h_hat) in float32, or None when head_rank == 0."""
        if self.head_down is None:
            return None
        h = corrected_hidden.float()
        return nn.functional.linear(
            nn.functional.linear(h, self.head_down.weight.float()), self.head_up.weight.float()
        )

    def extra_repr(self) -> str:
        return (
            f"method={self.method}, hidden_size={self.hidden_size}, rank={self.rank}, "
            f"max_positions={self.max_positions}, head_rank={self.head_rank}"
        )


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
