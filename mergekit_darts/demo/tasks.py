"""Three synthetic domains that mimic the paper's (GSM8K, HumanEval, instruction following).

Every example is one line of single-space-separated tokens from a closed vocabulary, so a
whitespace word-level tokenizer round-trips it exactly (``decode(encode(text)) == text``):

- math:     "tom has 5 apples . he buys 3 more . ... how many apples does tom have now ? answer :"
            -> "5 + 3 = 8 . 8 - 2 = 6 . #### 6"            (exact match of the ``#### n`` answer)
- code:     'def solve ( x ) : " return x plus 3 " ;'  -> "return x + 3"
            (HumanEval-style: prompt + completion + hidden asserts run in a sandbox)
- instruct: "instruction : reverse the words : cat dog sun . response :" -> "sun dog cat"
            (exact match)

``make_splits(domain, seed, ...)`` returns disjoint train / calib / test lists of examples
(dicts with ``prompt``, ``completion``, ``text`` and, for code, ``tests``), all from the seed.
"""

import random
import re
from typing import Callable, Dict, List, Optional, Sequence

DOMAINS = ("math", "code", "instruct")
MAX_NUMBER = 99  # numbers 0..MAX_NUMBER are single tokens

# ---------------------------------------------------------------------------------------------- math
NAMES = ["tom", "ann", "sam", "mia", "ben", "eva", "leo", "zoe"]
PRONOUNS = {"tom": "he", "sam": "he", "ben": "he", "leo": "he", "ann": "she", "mia": "she", "eva": "she", "zoe": "she"}
ITEMS = ["apples", "pears", "books", "coins", "cards", "eggs", "pens", "shells"]


def _math_example(rng: random.Random) -> dict:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    pron = PRONOUNS[name]
    value = rng.randint(2, 20)
    story = [f"{name} has {value} {item} ."]
    steps = []
    for _ in range(rng.randint(2, 3)):
        kind = rng.choice(["buy", "find", "give", "lose", "bags"])
        if kind in ("give", "lose") and value >= 2:
            amount = rng.randint(1, min(value - 1, 15))
            verb = "gives away" if kind == "give" else "loses"
            story.append(f"{pron} {verb} {amount} .")
            steps.append(f"{value} - {amount} = {value - amount} .")
            value -= amount
        elif kind == "bags" and value <= 40:
            bags, each = rng.randint(2, 4), rng.randint(2, 5)
            story.append(f"{pron} buys {bags} bags with {each} {item} each .")
            steps.append(f"{bags} * {each} = {bags * each} .")
            steps.append(f"{value} + {bags * each} = {value + bags * each} .")
            value += bags * each
        else:
            amount = rng.randint(1, min(15, MAX_NUMBER - value))
            verb = "buys" if kind != "find" else "finds"
            story.append(f"{pron} {verb} {amount} more .")
            steps.append(f"{value} + {amount} = {value + amount} .")
            value += amount
    prompt = " ".join(story + [f"how many {item} does {name} have now ? answer :"])
    completion = " ".join(steps + [f"#### {value}"])
    return {"prompt": prompt, "completion": completion, "answer": str(value)}


ANSWER = re.compile(r"####\s*(-?\d+)")


def extract_answer(completion: str) -> Optional[str]:
    """The number after the first ``####`` (GSM8K style), or None."""
    match = ANSWER.search(completion)
    return match.group(1) if match else None


def score_math(example: dict, completion: str) -> bool:
    return extract_answer(completion) == example["answer"]


# ---------------------------------------------------------------------------------------------- code
FUNC_NAMES = ["solve", "calc", "compute", "helper", "func", "process", "handle", "evaluate"]
SCALARS = ["x", "n", "v"]
PAIRS = [("a", "b"), ("p", "q"), ("x", "y")]
LISTS = ["xs", "nums", "items"]
WORDS_OP = {"plus": "+", "minus": "-", "times": "*"}


def _code_spec(rng: random.Random):
    """(doc, body, args, reference function, input maker) of one random function."""
    c, d = rng.randint(1, 9), rng.randint(2, 5)
    kind = rng.randrange(12)
    if kind < 3:  # x op c
        x = rng.choice(SCALARS)
        word = list(WORDS_OP)[kind]
        op = WORDS_OP[word]
        return (f"return {x} {word} {c}", f"return {x} {op} {c}", [x],
                lambda v, op=op, c=c: eval(f"{v} {op} {c}"), lambda r: [r.randint(-5, 20)])
    if kind < 6:  # a op b
        a, b = rng.choice(PAIRS)
        word = list(WORDS_OP)[kind - 3]
        op = WORDS_OP[word]
        return (f"return {a} {word} {b}", f"return {a} {op} {b}", [a, b],
                lambda u, v, op=op: eval(f"{u} {op} {v}"), lambda r: [r.randint(-5, 20), r.randint(-5, 20)])
    if kind == 6:  # larger / smaller of two
        a, b = rng.choice(PAIRS)
        which, fn = rng.choice([("larger", "max"), ("smaller", "min")])
        return (f"return the {which} of {a} and {b}", f"return {fn} ( {a} , {b} )", [a, b],
                {"max": max, "min": min}[fn], lambda r: [r.randint(-5, 20), r.randint(-5, 20)])
    xs = rng.choice(LISTS)
    make_list = lambda r: [[r.randint(0, 9) for _ in range(r.randint(1, 6))]]  # noqa: E731
    if kind == 7:  # aggregate of a list
        doc, fn, ref = rng.choice([("the sum of", "sum", sum), ("the length of", "len", len),
                                   ("the largest item of", "max", max), ("the smallest item of", "min", min)])
        return (f"return {doc} {xs}", f"return {fn} ( {xs} )", [xs], ref, make_list)
    if kind == 8:  # reorder a list
        doc, body, ref = rng.choice([
            (f"return {xs} sorted", f"return sorted ( {xs} )", sorted),
            (f"return {xs} reversed", f"return list ( reversed ( {xs} ) )", lambda l: list(reversed(l))),
            (f"return the first item of {xs}", f"return {xs} [ 0 ]", lambda l: l[0]),
            (f"return the last item of {xs}", f"return {xs} [ - 1 ]", lambda l: l[-1]),
        ])
        return doc, body, [xs], ref, make_list
    if kind == 9:  # count
        return (f"return how many times {c} is in {xs}", f"return {xs} . count ( {c} )", [xs],
                lambda l, c=c: l.count(c), lambda r: [[r.randint(0, 9) for _ in range(r.randint(1, 8))]])
    x = rng.choice(SCALARS)
    if kind == 10:  # predicates
        doc, body, ref = rng.choice([
            (f"return true if {x} is even", f"return {x} % 2 == 0", lambda v: v % 2 == 0),
            (f"return true if {x} is greater than {c}", f"return {x} > {c}", lambda v, c=c: v > c),
            (f"return true if {x} is less than {c}", f"return {x} < {c}", lambda v, c=c: v < c),
        ])
        return doc, body, [x], ref, lambda r: [r.randint(-5, 20)]
    # two steps
    return (f"return {x} plus {c} then times {d}", f"return ( {x} + {c} ) * {d}", [x],
            lambda v, c=c, d=d: (v + c) * d, lambda r: [r.randint(-5, 20)])


def _code_example(rng: random.Random) -> dict:
    doc, body, args, ref, make_inputs = _code_spec(rng)
    name = rng.choice(FUNC_NAMES)
    prompt = f'def {name} ( {" , ".join(args)} ) : " {doc} " ;'

    def finish(example, rng):  # hidden tests: only for accepted (unique) prompts
        tests = []
        for _ in range(5):
            inputs = make_inputs(rng)
            expected = ref(*[list(v) if isinstance(v, list) else v for v in inputs])
            tests.append(f"assert {name}({', '.join(repr(v) for v in inputs)}) == {expected!r}")
        example["tests"] = "\n".join(tests)

    return {"prompt": prompt, "completion": body, "entry_point": name, "_finish": finish}


def code_program(example: dict, completion: str) -> str:
    """The program whose function is checked: prompt + completion (one line); the hidden tests
    stay with the judge (they call it from the trusted process)."""
    return f"{example['prompt']} {completion.strip()}\n"


def entry_point(example: dict) -> str:
    found = re.match(r"\s*def\s+(\w+)", example["prompt"])
    return example.get("entry_point") or (found.group(1) if found else "")


def score_code(example: dict, completion: str) -> bool:
    from mergekit_darts.evaluation.sandbox import check_function

    return check_function(code_program(example, completion), entry_point(example), example["tests"],
                          check=None, timeout=5.0).passed


# ------------------------------------------------------------------------------------------ instruct
NOUNS = ["cat", "dog", "sun", "tree", "fish", "bird", "cup", "hat", "car", "box", "pen", "key",
         "moon", "star", "rain", "ship", "lamp", "door", "rock", "leaf", "milk", "bread", "ring", "bell"]


def _instruct_example(rng: random.Random) -> dict:
    words = rng.sample(NOUNS, rng.randint(2, 4))
    kind = rng.randrange(6)
    if kind == 0:
        task, answer = "reverse the words", list(reversed(words))
    elif kind == 1:
        task, answer = "sort the words", sorted(words)
    elif kind == 2:
        task, answer = "count the words", [str(len(words))]
    elif kind == 3:
        task, answer = "give the first word", words[:1]
    elif kind == 4:
        task, answer = "give the last word", words[-1:]
    else:
        task, answer = "repeat the words twice", words + words
    prompt = f"instruction : {task} : {' '.join(words)} . response :"
    return {"prompt": prompt, "completion": " ".join(answer)}


def score_instruct(example: dict, completion: str) -> bool:
    return " ".join(completion.split()) == example["completion"]


# ---------------------------------------------------------------------------------------------- all
GENERATORS: Dict[str, Callable[[random.Random], dict]] = {
    "math": _math_example, "code": _code_example, "instruct": _instruct_example,
}
SCORERS = {"math": score_math, "code": score_code, "instruct": score_instruct}
MAX_NEW_TOKENS = {"math": 48, "code": 16, "instruct": 16}
DOMAIN_SEED = {"math": 101, "code": 202, "instruct": 303}


def make_splits(domain: str, seed: int = 0, train: int = 3000, calib: int = 50,
                test: int = 100) -> Dict[str, List[dict]]:
    """Disjoint (by prompt) train / calib / test splits of ``domain``, deterministic for ``seed``.

    Test and calibration prompts are unique; train prompts are unique too when the domain has
    enough distinct prompts, otherwise train is filled by repeating its own examples.
    """
    if domain not in GENERATORS:
        raise ValueError(f"domain: unknown demo domain {domain!r}; choose one of {DOMAINS}")
    rng = random.Random(seed * 1000 + DOMAIN_SEED[domain])
    seen, pool = set(), []
    misses, wanted = 0, train + calib + test
    while len(pool) < wanted and misses < 5 * wanted:
        example = GENERATORS[domain](rng)
        if example["prompt"] in seen:
            misses += 1
            continue
        seen.add(example["prompt"])
        finish = example.pop("_finish", None)
        if finish is not None:
            finish(example, rng)
        example["text"] = f"{example['prompt']} {example['completion']}"
        pool.append(example)
    if len(pool) < calib + test + 1:
        raise ValueError(f"{domain}: only {len(pool)} distinct prompts; ask for fewer examples")
    test_split, calib_split = pool[:test], pool[test:test + calib]
    train_split = pool[test + calib:]
    while len(train_split) < train:  # a small prompt space: repeat the train examples (epochs)
        train_split = train_split + train_split[: train - len(train_split)]
    return {"train": train_split[:train], "calib": calib_split, "test": test_split}


def score(domain: str, example: dict, completion: str, **kwargs) -> bool:
    return SCORERS[domain](example, completion, **kwargs)


def vocabulary(splits: Sequence[Dict[str, List[dict]]]) -> List[str]:
    """Every token of every example (sorted, deterministic): the closed word-level vocabulary."""
    words = set(str(n) for n in range(MAX_NUMBER + 1))
    for domain_splits in splits:
        for examples in domain_splits.values():
            for example in examples:
                words.update(example["text"].split())
    return sorted(words)
