"""Generated domain families whose domains share vocabulary and surface forms, for the router
benchmark (benchmarks/routing/router_families.py, docs/routing.md "Measurements").

The demo's domains differ in surface form from their first token (``instruction :`` vs ``def`` vs a
story), which makes routing easy. These two families are built so that they do not:

- ``docs``: code / math / prose *documents* of 40-200 tokens from one vocabulary. Prose sentences
  come from one generator that the other two domains also use: a math record opens with 0-2 story
  sentences before its problem and worked steps, a code record's comments and strings are prose
  sentences, and numbers appear in all three. Surface forms are mixed within each domain (math:
  a story problem, a question / answer pair, or a list of equations; code: a commented function,
  a request followed by code, or print statements).
- ``chat``: short math / code / general requests, 10-60 tokens, each wrapped in one of the same
  four shells (``instruction : ... response :``, ``question : ... answer :``, ``user : ...
  assistant :``, or bare), so the first tokens never tell the domain.

Every example is a dict with ``prompt`` (what the expert is prompted with), ``completion`` and
``text`` (the whole record: what calibration and test records are), single-space tokens.
"""

import random
from typing import Callable, Dict, List

NAMES = ["tom", "ann", "sam", "mia", "ben", "eva", "leo", "zoe"]
PRONOUN = {n: ("he" if n in ("tom", "sam", "ben", "leo") else "she") for n in NAMES}
ITEMS = ["apples", "pears", "books", "coins", "cards", "eggs", "pens", "shells"]
NOUNS = ["cat", "dog", "sun", "tree", "fish", "bird", "cup", "hat", "car", "box", "lamp", "door", "rock", "leaf"]
PLACES = ["park", "shop", "school", "river", "garden", "market", "house", "hill"]
ADJECTIVES = ["big", "small", "red", "old", "new", "quiet", "happy", "cold", "warm", "bright"]
VERBS = ["walked", "ran", "looked", "went", "came", "drove"]


def _n(rng, low=1, high=20) -> int:
    return rng.randint(low, high)


def prose_sentence(rng: random.Random) -> str:
    name, noun, place = rng.choice(NAMES), rng.choice(NOUNS), rng.choice(PLACES)
    kind = rng.randrange(6)
    if kind == 0:
        return f"{name} {rng.choice(VERBS)} to the {place} with the {noun} ."
    if kind == 1:
        return f"the {noun} was {rng.choice(ADJECTIVES)} and {rng.choice(ADJECTIVES)} ."
    if kind == 2:
        return f"then {PRONOUN[name]} saw {_n(rng)} {rng.choice(ITEMS)} near the {place} ."
    if kind == 3:
        return f"{name} said that the {noun} in the {place} is {rng.choice(ADJECTIVES)} ."
    if kind == 4:
        return f"it was a {rng.choice(ADJECTIVES)} day and the {noun} {rng.choice(VERBS)} away ."
    return f"{name} and {rng.choice(NAMES)} sat by the {rng.choice(ADJECTIVES)} {noun} for {_n(rng, 2, 9)} hours ."


def _story_problem(rng):
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    value = _n(rng, 2, 20)
    story, steps = [f"{name} has {value} {item} ."], []
    for _ in range(rng.randint(2, 4)):
        amount = _n(rng, 1, 9)
        if rng.random() < 0.4 and value > amount:
            story.append(f"{PRONOUN[name]} gives away {amount} .")
            steps.append(f"{value} - {amount} = {value - amount} .")
            value -= amount
        else:
            story.append(f"{PRONOUN[name]} buys {amount} more .")
            steps.append(f"{value} + {amount} = {value + amount} .")
            value += amount
    return story + [f"how many {item} does {name} have now ?"], steps + [f"the answer is {value} ."]


def math_doc(rng: random.Random) -> dict:
    opening = [prose_sentence(rng) for _ in range(rng.randint(0, 2))]
    form = rng.randrange(3)
    if form == 0:
        story, steps = _story_problem(rng)
        prompt, completion = opening + story, steps
    elif form == 1:
        story, steps = _story_problem(rng)
        prompt, completion = opening + ["question :"] + story + ["answer :"], steps
    else:
        equations = []
        for _ in range(rng.randint(3, 6)):
            a, b = _n(rng), _n(rng)
            op, value = rng.choice([("+", a + b), ("-", a - b), ("*", a * b)])
            equations.append(f"{a} {op} {b} = {value} .")
        prompt, completion = opening + ["solve each one :"] + equations[:2], equations[2:]
    return _record(prompt, completion)


def _function(rng):
    item, noun = rng.choice(ITEMS), rng.choice(NOUNS)
    c = _n(rng, 1, 9)
    name = rng.choice([f"count_{item}", f"add_{noun}", "total", "helper", "solve"])
    bodies = [
        [f"def {name} ( xs ) :", "total = 0", "for x in xs :", "total = total + x", "return total"],
        [f"def {name} ( x , y ) :", f"if x > {c} :", "return x + y", "else :", "return x - y"],
        [f"def {name} ( {noun} ) :", f"return {noun} * {c}"],
        [f"def {name} ( xs ) :", "return sorted ( xs )", f"print ( {name} ( [ {c} , {_n(rng)} ] ) )"],
    ]
    return rng.choice(bodies)


def code_doc(rng: random.Random) -> dict:
    form = rng.randrange(3)
    if form == 0:
        head = [f"# {prose_sentence(rng)}" for _ in range(rng.randint(1, 2))]
        body = _function(rng)
        prompt, completion = head + body[:1], body[1:]
    elif form == 1:
        body = _function(rng)
        prompt = [f"write a python function : {prose_sentence(rng)}", body[0]]
        completion = body[1:] + [f"# {prose_sentence(rng)}"]
    else:
        lines = [f'print ( " {prose_sentence(rng)} " )' for _ in range(rng.randint(2, 4))]
        prompt, completion = lines[:1], lines[1:] + [f"x = {_n(rng)}", "print ( x )"]
    return _record(prompt, completion)


def prose_doc(rng: random.Random) -> dict:
    sentences = [prose_sentence(rng) for _ in range(rng.randint(5, 14))]
    return _record(sentences[:2], sentences[2:])


def _record(prompt: List[str], completion: List[str]) -> dict:
    prompt_text, completion_text = " ".join(prompt), " ".join(completion)
    return {"prompt": prompt_text, "completion": completion_text, "text": f"{prompt_text} {completion_text}"}


SHELLS = [("instruction :", "response :"), ("question :", "answer :"), ("user :", "assistant :"), ("", "")]


def _shell(rng, body: str, answer: str) -> dict:
    head, tail = rng.choice(SHELLS)
    prompt = " ".join(part for part in (head, body, tail) if part)
    return {"prompt": prompt, "completion": answer, "text": f"{prompt} {answer}"}


def chat_math(rng: random.Random) -> dict:
    story, steps = _story_problem(rng)
    if rng.random() < 0.3:
        story = [prose_sentence(rng)] + story
    return _shell(rng, " ".join(story), " ".join(steps))


def chat_code(rng: random.Random) -> dict:
    body = _function(rng)
    kind = rng.randrange(3)
    if kind == 0:
        request = f"write a python function {body[0].split()[1]} that works on {rng.choice(ITEMS)} ."
    elif kind == 1:
        request = f"fix this code : {' '.join(body[:2])}"
    else:
        request = f"what does this code print ? {' '.join(body)}"
    return _shell(rng, request, " ".join(body[1:]))


def chat_general(rng: random.Random) -> dict:
    words = rng.sample(NOUNS, rng.randint(2, 4))
    kind = rng.randrange(5)
    if kind == 0:
        body, answer = f"reverse the words : {' '.join(words)} .", " ".join(reversed(words))
    elif kind == 1:
        body, answer = f"write a short story about the {words[0]} and the {words[1]} .", prose_sentence(rng)
    elif kind == 2:
        body, answer = f"describe the {rng.choice(PLACES)} in {_n(rng, 3, 9)} words .", prose_sentence(rng)
    elif kind == 3:
        body, answer = f"give the first word : {' '.join(words)} .", words[0]
    else:
        body, answer = f"{prose_sentence(rng)} what is {rng.choice(NAMES)} doing ?", prose_sentence(rng)
    return _shell(rng, body, answer)


FAMILIES: Dict[str, Dict[str, Callable[[random.Random], dict]]] = {
    "docs": {"code": code_doc, "math": math_doc, "prose": prose_doc},
    "chat": {"math": chat_math, "code": chat_code, "general": chat_general},
}


def make_splits(family: str, seed: int = 0, train: int = 1500, calib: int = 50, test: int = 100
                ) -> Dict[str, Dict[str, List[dict]]]:
    """{domain: {train, calib, test}}: disjoint by text, deterministic for ``seed``."""
    out = {}
    for index, (domain, make) in enumerate(FAMILIES[family].items()):
        rng = random.Random(seed * 1000 + 17 * (index + 1) + len(family))
        seen, pool = set(), []
        while len(pool) < train + calib + test:
            example = make(rng)
            if example["text"] not in seen:
                seen.add(example["text"])
                pool.append(example)
        out[domain] = {"test": pool[:test], "calib": pool[test:test + calib], "train": pool[test + calib:]}
    return out


def vocabulary(splits: Dict[str, Dict[str, List[dict]]]) -> List[str]:
    words = {str(n) for n in range(-20, 401)}
    for parts in splits.values():
        for examples in parts.values():
            for example in examples:
                words.update(example["text"].split())
    return sorted(words)
