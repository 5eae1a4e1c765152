"""Calibration prompts written by the expert (``calibration.synthesize: N``, docs/quality.md).

The expert (or ``calibration.synthesize_writer``, e.g. the merge's base model, for an expert that no
longer writes prompts well) writes ``N`` new prompts of its domain from the user's training prompts: it samples a
continuation of the first tokens of a randomly chosen user prompt (the part every user prompt shares,
such as BOS or a chat template's header, plus 1 to half of the rest) until the prompts' common ending
(the longest token suffix every user prompt shares, e.g. ``answer :`` or the chat template's
generation prompt). A candidate is kept only when it

- is complete (it reached that ending, or with no common ending, the chosen prompt's length),
- is as long as the user's prompts are (between the shortest and 1.25x the longest),
- holds no special token besides the shared beginning and ending,
- is new: no copy of a user prompt or of an earlier candidate,
- is no held-out prompt's near duplicate: it neither contains a held-out prompt's content nor is
  as similar to one as ``NEAR_DUPLICATE`` (difflib's ratio over tokens).

Only the training prompts (the ``held_out`` split the training will use, by the same seed) seed the
expert, so the held-out measurements never see a prompt derived from a held-out one. Sampling is
seeded; the capture (``domains.py``) caches the result and then has the expert answer every prompt,
user-written or synthesized, as ``continue_tokens`` does.
"""

import difflib
import logging
import math
import random
from typing import Dict, List, Sequence, Tuple

import torch

from mergekit_darts.console import progress_bar
from mergekit_darts.repair.capture.forward import continue_prompts, pad_rows, stop_ids as model_stop_ids
from mergekit_darts.repair.capture.prompts import Prompts, split_held_out

LOG = logging.getLogger(__name__)

NEAR_DUPLICATE = 0.9  # difflib ratio over content tokens at or above which a candidate copies a held-out prompt
MAX_ROUNDS = 12  # sampling rounds before giving up on reaching N
MAX_SAMPLES = 20  # ... or once this many samples per requested prompt were drawn
LONGEST = 1.25  # a candidate may be this much longer than the longest user prompt
REJECTIONS = ("incomplete", "length", "special", "duplicate", "near_held_out")


def common_prefix(rows: Sequence[Sequence[int]]) -> int:
    """Length of the longest token prefix that every row shares."""
    first, n = rows[0], min(len(row) for row in rows)
    return next((k for k in range(n) if any(row[k] != first[k] for row in rows)), n)


def common_suffix(rows: Sequence[Sequence[int]]) -> int:
    return common_prefix([list(reversed(row)) for row in rows])


def split_prompts(rows: Sequence[Sequence[int]]) -> Tuple[int, int]:
    """(shared beginning, shared ending) lengths of the user's prompts. With fewer than two prompts,
    or when they share most of their tokens, each part is capped at half the shortest prompt, so
    every prompt keeps content of its own."""
    shortest = min(len(row) for row in rows)
    head = min(common_prefix(rows), shortest // 2) if len(rows) > 1 else min(1, shortest // 2)
    tail = min(common_suffix(rows), (shortest - head) // 2) if len(rows) > 1 else 0
    return head, tail


def _contains(longer: Sequence[int], shorter: Sequence[int]) -> bool:
    n = len(shorter)
    return n > 0 and any(list(longer[i:i + n]) == list(shorter) for i in range(len(longer) - n + 1))


def is_near_duplicate(candidate: Sequence[int], held: Sequence[int], threshold: float = NEAR_DUPLICATE) -> bool:
    """``candidate`` holds ``held`` (token for token) or is at least ``threshold`` similar to it."""
    if _contains(candidate, held):
        return True
    matcher = difflib.SequenceMatcher(None, list(candidate), list(held), autojunk=False)
    return matcher.real_quick_ratio() >= threshold and matcher.quick_ratio() >= threshold \
        and matcher.ratio() >= threshold


class _Filter:
    """Keeps a candidate only when it passes every check of the module docstring; counts rejections."""

    def __init__(self, train: List[List[int]], held: List[List[int]], head: int, tail: int,
                 special: set, threshold: float):
        everything = train + held
        self.head, self.tail, self.special, self.threshold = head, tail, special, threshold
        self.ending = list(train[0][len(train[0]) - tail:]) if tail else []
        self.shortest = min(len(row) for row in everything)
        self.longest = math.ceil(LONGEST * max(len(row) for row in everything))
        self.seen = {tuple(row) for row in everything}
        self.held = [self.content(row) for row in held]
        self.rejected = {reason: 0 for reason in REJECTIONS}

    def content(self, row: Sequence[int]) -> List[int]:
        return list(row[self.head:len(row) - self.tail])

    def complete(self, sample: List[int], prefix: int, chosen: List[int], stopped: bool, stop_ids: set):
        """The candidate prompt in ``sample`` (prefix + the expert's tokens), or None if it never ended."""
        if self.ending:
            n = len(self.ending)
            for end in range(max(prefix + 1, n), len(sample) + 1):
                if sample[end - n:end] == self.ending:
                    return sample[:end]
            # the expert ended its turn where the ending (a chat template's) begins with a stop token
            if stopped and self.ending[0] in stop_ids:
                return sample + self.ending
            return None
        if len(sample) >= len(chosen):
            return sample[:len(chosen)]
        return sample if stopped else None

    def check(self, candidate) -> str:
        """"" when kept, else the reason of the rejection."""
        if candidate is None:
            return "incomplete"
        if not self.shortest <= len(candidate) <= self.longest:
            return "length"
        body = self.content(candidate)
        if any(token in self.special for token in body):
            return "special"
        if tuple(candidate) in self.seen:
            return "duplicate"
        if any(is_near_duplicate(body, held, self.threshold) for held in self.held):
            return "near_held_out"
        return ""

    def keep(self, candidate) -> bool:
        reason = self.check(candidate)
        if reason:
            self.rejected[reason] += 1
            return False
        self.seen.add(tuple(candidate))
        return True


def synthesize_prompts(model, train: List[List[int]], held: List[List[int]], count: int, ctx, *,
                       temperature: float, seed: int, stop_ids: set, special_ids: set, desc: str,
                       threshold: float = NEAR_DUPLICATE, writer: str = "the expert"
                       ) -> Tuple[List[List[int]], Dict[str, int]]:
    """``count`` new prompts (token ids) written by ``model`` from the ``train`` prompts; never one
    that is a ``held`` prompt's near duplicate. Returns (prompts, {"requested", "kept", "sampled" (the
    samples examined), and each rejection reason: count}). Fewer than ``count`` (logged) when the expert does not write
    enough acceptable prompts in ``MAX_ROUNDS`` rounds."""
    if not train:
        raise ValueError("synthesize: needs at least one training prompt to start from")
    head, tail = split_prompts(train + held)
    checks = _Filter(train, held, head, tail, special_ids, threshold)
    rng = random.Random(seed)
    kept: List[List[int]] = []
    sampled = 0
    # kept prompts over all rounds (each round's sampling has its own bar from continue_prompts)
    bar = progress_bar(count, f"{desc}: prompts kept", bars=ctx.progress, lines=ctx.lines, unit="prompts", leave=True)
    for round_ in range(MAX_ROUNDS):
        if len(kept) >= count or sampled >= MAX_SAMPLES * count:
            break
        # twice what is missing, more once the acceptance rate is known (at most 8x)
        rate = len(kept) / sampled if sampled else 0.5
        draws = min(8 * count, math.ceil((count - len(kept)) / max(rate, 1 / 8) * 1.2))
        LOG.info("%s: round %d of at most %d: sampling %d prompt(s); %d of %d kept so far (%d samples examined)",
                 desc, round_ + 1, MAX_ROUNDS, draws, len(kept), count, sampled)
        chosen = [train[rng.randrange(len(train))] for _ in range(draws)]
        prefixes = []
        for row in chosen:
            own = len(row) - head - tail
            prefixes.append(list(row[:head + rng.randint(1, max(1, own // 2))]))
        budget = max(1, checks.longest - min(len(p) for p in prefixes))
        samples = continue_prompts(model, prefixes, budget, ctx, stop_ids, f"{desc} (round {round_ + 1})",
                                   temperature=temperature, seed=seed + 7919 * round_)
        for prefix, row, sample in zip(prefixes, chosen, samples):
            if len(kept) >= count:
                break
            sampled += 1
            stopped = len(sample) - len(prefix) < min(budget, ctx.max_positions - len(prefix))
            candidate = checks.complete(sample, len(prefix), row, stopped, stop_ids)
            if checks.keep(candidate):
                kept.append(candidate)
                bar.update(1)
    bar.close()
    stats = {"requested": count, "kept": len(kept), "sampled": sampled, **checks.rejected}
    if len(kept) < count:
        LOG.warning("%s: %s wrote %d acceptable prompt(s) of the %d asked for in %d samples (rejected: %s)",
                    desc, writer, len(kept), count, sampled, {k: v for k, v in checks.rejected.items() if v})
    return kept, stats


STATS = ("requested", "kept", "sampled", *REJECTIONS)
SYNTHESIS_VERSION = 3  # bump when the sampling or the filters change: cached prompts are then rewritten


def writer_slot(ctx, spec):
    """The slot of ``calibration.synthesize_writer``, checked to share the merged model's vocabulary and
    tokenization (its ids are read with the merged tokenizer)."""
    from transformers import AutoTokenizer

    from mergekit_darts.config import SurgeryConfigError
    from mergekit_darts.repair.capture.models import model_sizes, resolve_model_dir
    from mergekit_darts.repair.capture.prompts import encode

    where = f"surgery.domains.{spec.name}.calibration.synthesize_writer"
    try:
        model_dir = resolve_model_dir(spec.synthesize_writer)
    except SurgeryConfigError as error:
        raise SurgeryConfigError(f"{where}: {error}") from None
    vocab = model_sizes(model_dir, ctx.trust_remote_code)[1]
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=ctx.trust_remote_code)
    text = next((t for t in spec.texts if t.strip()), "")
    if vocab != ctx.vocab_size or encode(tokenizer, text, spec.add_special_tokens) != encode(
            ctx.tokenizer, text, spec.add_special_tokens):
        raise SurgeryConfigError(
            f"{where}: {spec.synthesize_writer!r} does not share the merged model's vocabulary and tokenizer "
            f"(vocabulary {vocab} vs {ctx.vocab_size}); use a model of the same family, e.g. the merge's base model")
    return ctx.slot(model_dir)


def add_synthesized(slot, prompts: Prompts, spec, ctx) -> None:
    """Append ``spec.synthesize`` prompts written by the model in ``slot`` (the expert, or
    ``synthesize_writer``) to ``prompts``; cached, keyed by that model, the user's prompt ids and
    every setting that changes the result."""
    real = prompts.ids[:prompts.real] if prompts.real is not None else list(prompts.ids)
    train_idx, held_idx = split_held_out(len(real), spec.held_out, spec.sample_seed)
    train, held = [real[i] for i in train_idx.tolist()], [real[i] for i in held_idx.tolist()]
    stop = model_stop_ids(slot.model_dir, ctx.trust_remote_code)
    key = ctx.key("synthesized", slot.model_dir, ids=real, synthesize=spec.synthesize, stop_ids=list(stop),
                    temperature=spec.synthesize_temperature, seed=spec.sample_seed, held_out=spec.held_out,
                    near_duplicate=NEAR_DUPLICATE, max_positions=ctx.max_positions, version=SYNTHESIS_VERSION)
    label = f"synthesized.{spec.name}"
    expected = {"input_ids": ((None, None), torch.long), "lengths": ((None,), torch.long),
                "stats": ((len(STATS),), torch.long)}
    entry = ctx.cache.load(label, key, expected)
    if entry is None:
        try:
            model = slot.get()
            rows, stats = synthesize_prompts(
                model, train, held, spec.synthesize, ctx, temperature=spec.synthesize_temperature,
                seed=spec.sample_seed, stop_ids=set(stop), special_ids=set(ctx.tokenizer.all_special_ids),
                desc=f"synthesize · {spec.name}", writer=writer_name(spec))
            del model
        finally:
            if spec.synthesize_writer is not None:
                slot.free()  # the writer is not needed again; an expert's slot stays for its capture
        entry = {"input_ids": pad_rows(rows, ctx.pad_id)[0] if rows else torch.zeros((0, 1), dtype=torch.long),
                 "lengths": torch.tensor([len(row) for row in rows], dtype=torch.long),
                 "stats": torch.tensor([stats[name] for name in STATS], dtype=torch.long)}
        ctx.cache.save(label, key, entry)
    rows = [row[:n].tolist() for row, n in zip(entry["input_ids"], entry["lengths"].tolist())]
    prompts.ids, prompts.real = real + rows, len(real)
    prompts.synthesis = dict(zip(STATS, entry["stats"].tolist()))
    LOG.info("domain %s: %d prompt(s) written by %s (%s)", spec.name, len(rows), writer_name(spec), prompts.synthesis)


def writer_name(spec) -> str:
    """Who writes a domain's prompts, as the log lines say it."""
    if spec.synthesize_writer is None:
        return "the expert"
    return f"the synthesize_writer ({spec.synthesize_writer})"
