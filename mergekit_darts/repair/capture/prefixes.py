"""Prefixes of held-out records for the behaviour figures (docs/quality.md, "Behaviour").

A held-out record that leaves less room under ``max_positions`` than ``continue_tokens`` (a document
cut to ``max_positions``, or close to it) has no whole continuation to compare with. Its behaviour is
measured instead on its first ``max_positions - continue_tokens`` tokens, followed by the expert's
greedy continuation from there. These prefix rows are captured beside the domain (with the same
models, passes and cache as its own rows), only for held-out records, and are never training rows:
the correction never sees them, and the held-out split is the one training uses (``split_held_out``
with the spec's ``held_out`` and ``sample_seed``, which are the surgery's ``held_out`` and the run's seed).
The cost is bounded: at most one continuation and one forward pass per held-out record and model.
"""

import dataclasses
from typing import Dict, List, Tuple

import torch

from mergekit_darts.repair.capture.prompts import Prompts, split_held_out

# "<domain>-prefixes": no domain name holds a "-", so it names no domain and no "expert.<domain>.*" cache entry
PREFIX_SUFFIX = "-prefixes"


def held_out_prefixes(ids: List[List[int]], held_out: float, seed: int, continue_tokens: int,
                      max_positions: int) -> Tuple[torch.LongTensor, List[List[int]]]:
    """(record index of each prefix, the prefixes): one per held-out record of ``ids`` (the user's
    prompts, tokenized) whose room under ``max_positions`` is less than ``continue_tokens``, cut to
    ``max_positions - continue_tokens`` tokens. Empty when nothing is continued or no token would be left."""
    cut = max_positions - continue_tokens
    if continue_tokens <= 0 or cut < 1:
        return torch.zeros(0, dtype=torch.long), []
    _, held = split_held_out(len(ids), held_out, seed)
    records = [i for i in held.tolist() if len(ids[i]) > cut]
    return torch.tensor(records, dtype=torch.long), [list(ids[i][:cut]) for i in records]


def prefix_specs(specs, prompts: Dict[str, Prompts], max_positions: int) -> Dict[str, tuple]:
    """{domain: (its prefix spec, the prefixes' Prompts, their record indices)} of every domain with
    held-out records to cut. The prefix spec is the domain's, named ``<domain>-prefixes`` and
    greedy-continued only (no samples, no synthesis); its prompts are the prefixes."""
    out = {}
    for spec in specs:
        user = prompts[spec.name]
        ids = user.ids if user.real is None else user.ids[:user.real]  # never a synthesized prompt
        records, cut = held_out_prefixes(ids, spec.held_out, spec.sample_seed, spec.continue_tokens, max_positions)
        if cut:
            prefix = dataclasses.replace(spec, name=spec.name + PREFIX_SUFFIX, texts=[], continue_samples=0,
                                         synthesize=0, synthesize_writer=None)
            out[spec.name] = (prefix, Prompts(ids=cut), records)
    return out
