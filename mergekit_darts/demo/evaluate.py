"""Greedy batched generation (left padding) and per-domain scoring on the held-out test sets."""

from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

import torch

from mergekit_darts.demo import tasks

_CODE_CACHE: Dict[tuple, bool] = {}  # (program, tests) -> passed; variants often write the same code


@torch.no_grad()
def generate(model, tokenizer, prompts: List[str], max_new_tokens: int, batch_size: int = 64) -> List[str]:
    """Greedy completions of ``prompts`` (decoded, without the prompt and special tokens)."""
    tokenizer.padding_side = "left"
    completions = []
    for start in range(0, len(prompts), batch_size):
        batch = tokenizer(prompts[start:start + batch_size], return_tensors="pt", padding=True)
        output = model.generate(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], do_sample=False,
            max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        new = output[:, batch["input_ids"].shape[1]:]
        completions += tokenizer.batch_decode(new, skip_special_tokens=True)
    return [" ".join(c.split()) for c in completions]


def score_completions(domain: str, examples: List[dict], completions: List[str]) -> List[bool]:
    if domain != "code":
        return [tasks.score(domain, ex, c) for ex, c in zip(examples, completions)]
    keys = [(tasks.code_program(ex, c), ex["tests"]) for ex, c in zip(examples, completions)]
    todo = {key: (ex, c) for key, ex, c in zip(keys, examples, completions) if key not in _CODE_CACHE}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for key, passed in zip(todo, pool.map(lambda item: tasks.score_code(*item), todo.values())):
            _CODE_CACHE[key] = passed
    return [_CODE_CACHE[key] for key in keys]


def score_model(model, tokenizer, test: Dict[str, List[dict]], domains: Optional[List[str]] = None,
                samples: Optional[Dict[str, list]] = None, progress: bool = False,
                desc: str = "scoring") -> Dict[str, float]:
    """Accuracy (%) per domain; ``samples`` (if given) collects a few (prompt, completion, ok)."""
    from tqdm.auto import tqdm

    scores = {}
    for domain in tqdm(domains or list(test), desc=desc, disable=not progress, leave=False):
        examples = test[domain]
        completions = generate(model, tokenizer, [ex["prompt"] for ex in examples], tasks.MAX_NEW_TOKENS[domain])
        ok = score_completions(domain, examples, completions)
        scores[domain] = 100.0 * sum(ok) / max(1, len(ok))
        if samples is not None:
            samples[domain] = [(ex["prompt"], c, o) for ex, c, o in list(zip(examples, completions, ok))[:3]]
    return scores
