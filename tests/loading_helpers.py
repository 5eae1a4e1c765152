"""Helpers for the loading-mode tests: a tiny Darts directory (hidden 64, so bitsandbytes' 64-wide 4-bit
blocks fit on CPU) with random surgery incl. a head correction, and the independent manual computation."""

import threading

import torch

from helpers import realistic_padding
from mergekit_darts.remote_code.modeling_darts import default_position_ids
from mergekit_darts.tiny import make_random_model
from test_modeling import PROMPTS, make_darts_dir, tokenizer_for

# a correction counts as visibly active when it moves some logit by more than this (measured ~5.6)
VISIBLE = 1.0


def make_tiny_darts_dir(path, head_rank=3):
    """Pad = eos with a non-zero embedding row (helpers.realistic_padding), random surgery exported."""
    make_random_model(path, arch="llama", seed=3, hidden_size=64)
    realistic_padding(path)
    return make_darts_dir(path, head_rank=head_rank)


def padded_batch(path, prompts=PROMPTS):
    batch = tokenizer_for(path)(list(prompts), return_tensors="pt", padding=True)
    assert (batch.attention_mask == 0).any()  # really left padded
    return batch


@torch.no_grad()
def manual_rows(plain, surgeries, batch):
    """Row r: lm_head(s_r(h_r, pos_r)) (+ head correction), or the plain logits where s_r is None;
    h from the plain model (any load mode), positions from the attention mask as generate derives them."""
    hidden = plain(**batch, output_hidden_states=True).hidden_states[-1]
    positions = default_position_ids(hidden.shape[1], batch["attention_mask"])
    rows = []
    for row, surgery in enumerate(surgeries):
        h = hidden[row:row + 1]
        if surgery is None:
            rows.append(plain.lm_head(h).float())
            continue
        corrected = surgery(h, positions[row:row + 1])
        logits = plain.lm_head(corrected.to(plain.lm_head.weight.dtype)).float()
        if surgery.head_rank:
            logits = logits + surgery.head_correction(corrected)
        rows.append(logits)
    return torch.cat(rows)


def run_concurrently(checks, steps):
    """Run each ``check(step) -> [labels of what differed]`` in its own thread, ``steps`` times, all
    threads released together; returns (errors, mismatches) with the thread's name / the step."""
    mismatches, errors = [], []
    start = threading.Barrier(len(checks))

    def worker(name, check):
        start.wait()
        try:
            with torch.no_grad():
                for step in range(steps):
                    mismatches.extend((label, step) for label in check(step))
        except Exception as error:  # reported by the caller with the thread's name
            errors.append((name, repr(error)))

    threads = [threading.Thread(target=worker, args=item) for item in checks.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors, mismatches
