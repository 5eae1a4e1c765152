"""The two new domains of family v2 (issue 44), beside the demo's math, code and instruct: exact tasks
a 135M model can learn from a few thousand chats and a script can score to the letter.

- units: "convert 3 hours to minutes . answer :" -> "3 * 60 = 180 minutes"; the other way,
  "convert 180 minutes to hours . answer :" -> "180 / 60 = 3 hours" (every result a whole number);
- dates: "what date is 8 days after march 25 ? answer :" -> "march 25 + 8 days = april 2" (a year
  without 29 february), or "what day is 3 days after monday ? answer :" -> "monday + 3 days = thursday";
  1 to 9 days (with up to 40 the LoRA expert learned 16 %, a rank-16 LoRA on every linear at lr 2e-3
  7 % after 150 steps; with 1 to 9 it learned 53 % in those 150 steps, 60 test prompts: the task must
  be learnt for its domain to say anything).

A completion counts when it equals the reference after whitespace is normalised (the worked step
included, as the demo's instruct scorer does). ``make_splits`` gives disjoint test / calib / train
lists for any of the five domains, test first, so test and calibration prompts never depend on how
many training examples are asked for.
"""

import random
from typing import Dict, List

from mergekit_darts.demo import tasks

NEW_DOMAINS = ("units", "dates")
DOMAINS = (*tasks.DOMAINS, *NEW_DOMAINS)
# seeds of the new domains' generators (the demo's domains keep their own in tasks.DOMAIN_SEED)
NEW_DOMAIN_SEED = {"units": 404, "dates": 505}

# (larger unit, smaller unit, how many smaller in one larger)
CONVERSIONS = [("hours", "minutes", 60), ("minutes", "seconds", 60), ("days", "hours", 24), ("weeks", "days", 7),
               ("kilometers", "meters", 1000), ("meters", "centimeters", 100), ("kilograms", "grams", 1000),
               ("liters", "milliliters", 1000), ("dollars", "cents", 100), ("feet", "inches", 12),
               ("yards", "feet", 3), ("dozens", "eggs", 12)]
MONTHS = [("january", 31), ("february", 28), ("march", 31), ("april", 30), ("may", 31), ("june", 30),
          ("july", 31), ("august", 31), ("september", 30), ("october", 31), ("november", 30), ("december", 31)]
WEEKDAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]


def _units_example(rng: random.Random) -> dict:
    large, small, factor = rng.choice(CONVERSIONS)
    count = rng.randint(1, 40)
    if rng.random() < 0.5:
        prompt = f"convert {count} {large} to {small} . answer :"
        completion = f"{count} * {factor} = {count * factor} {small}"
    else:
        prompt = f"convert {count * factor} {small} to {large} . answer :"
        completion = f"{count * factor} / {factor} = {count} {large}"
    return {"prompt": prompt, "completion": completion}


DATES_MAX_OFFSET = 9


def _dates_example(rng: random.Random) -> dict:
    offset = rng.randint(1, DATES_MAX_OFFSET)
    direction = rng.choice(["after", "before"])
    sign = 1 if direction == "after" else -1
    if rng.random() < 0.3:
        start = rng.randrange(7)
        prompt = f"what day is {offset} days {direction} {WEEKDAYS[start]} ? answer :"
        result = WEEKDAYS[(start + sign * offset) % 7]
        return {"prompt": prompt, "completion": f"{WEEKDAYS[start]} {'+' if sign > 0 else '-'} {offset} days = {result}"}
    month = rng.randrange(12)
    day = rng.randint(1, MONTHS[month][1])
    day_of_year = sum(length for _, length in MONTHS[:month]) + day - 1 + sign * offset
    day_of_year %= 365
    target = 0
    while day_of_year >= MONTHS[target][1]:
        day_of_year -= MONTHS[target][1]
        target += 1
    start_text = f"{MONTHS[month][0]} {day}"
    prompt = f"what date is {offset} days {direction} {start_text} ? answer :"
    completion = f"{start_text} {'+' if sign > 0 else '-'} {offset} days = {MONTHS[target][0]} {day_of_year + 1}"
    return {"prompt": prompt, "completion": completion}


GENERATORS = {"units": _units_example, "dates": _dates_example}


def score_exact(example: dict, completion: str) -> bool:
    """The reference completion, worked step and all, after whitespace is normalised."""
    return " ".join(completion.split()) == " ".join(example["completion"].split())


def make_splits(domain: str, seed: int = 0, train: int = 2000, calib: int = 50,
                test: int = 100) -> Dict[str, List[dict]]:
    """Disjoint (by prompt) test / calib / train lists of ``domain``, deterministic for ``seed``; the
    demo's domains come from their own generators (``tasks.make_splits``)."""
    if domain in tasks.DOMAINS:
        return tasks.make_splits(domain, seed, train=train, calib=calib, test=test)
    if domain not in GENERATORS:
        raise ValueError(f"domain: unknown family v2 domain {domain!r}; choose one of {DOMAINS}")
    rng = random.Random(seed * 1000 + NEW_DOMAIN_SEED[domain])
    wanted, by_prompt = train + calib + test, {}
    for _ in range(20 * wanted):  # first come first kept: test, then calib, then train
        example = GENERATORS[domain](rng)
        by_prompt.setdefault(example["prompt"], {**example, "text": f"{example['prompt']} {example['completion']}"})
        if len(by_prompt) == wanted:
            break
    pool = list(by_prompt.values())
    if len(pool) < test + calib + 1:
        raise ValueError(f"{domain}: only {len(pool)} distinct prompts; ask for fewer examples")
    train_split = pool[test + calib:]
    while len(train_split) < train:  # a small prompt space: the train examples again (epochs)
        train_split = train_split + train_split[: train - len(train_split)]
    return {"test": pool[:test], "calib": pool[test:test + calib], "train": train_split[:train]}


def score_completions(domain: str, examples: List[dict], completions: List[str]) -> List[bool]:
    """One bool per completion: the demo's scorers for its domains (code runs in the sandbox), exact
    match for the new ones."""
    if domain in tasks.DOMAINS:
        from mergekit_darts.demo.evaluate import score_completions as demo_scores

        return demo_scores(domain, examples, completions)
    if domain not in GENERATORS:
        raise ValueError(f"domain: unknown family v2 domain {domain!r}; choose one of {DOMAINS}")
    return [score_exact(example, completion) for example, completion in zip(examples, completions)]
