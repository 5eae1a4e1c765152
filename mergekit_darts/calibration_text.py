"""A calibration record's text, made safely: the field's value, a template rendered from plain field
names only, and texts cut to what ``max_positions`` can use before anything tokenizes them.

Torch-free; ``repair.capture.calibration`` (loading) and ``preflight`` (the pre-merge checks) use it.
"""

import re
import string
from typing import Any, List, Mapping, Optional, Sequence, Tuple

from mergekit_darts.errors import SurgeryConfigError

_PLAIN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# template values that render as themselves; anything else (a list, a dict, a bool) is not a text
_SCALARS = (str, int, float)
# chars one token can cover when the tokenizer is not known (longer than any real vocabulary's tokens)
FALLBACK_TOKEN_CHARS = 256


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def field_text(value: Any, field: str, record: int, source: str, where: str) -> str:
    """The text of ``record``'s ``field``: a string, or "" for a missing value (skipped and counted at
    tokenization). A number, list or mapping is an error: turned into text silently it would
    calibrate on ``"[1, 2]"`` or ``"42"`` without a word."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    kind = type(value).__name__
    hint = ("write it as a string, or format it with a template such as '{%s}'" % field
            if isinstance(value, (int, float)) and not isinstance(value, bool)
            else "give a text field (or a template that names text fields)")
    raise SurgeryConfigError(
        f"{where}.field: record {record} of {source}: field {field!r} holds {kind} {_preview(value)}, not text; {hint}")


def template_fields(template: str, where: str) -> List[str]:
    """The field names ``template`` uses. Only plain names (``{question}``) are allowed: attribute and
    index access (``{q.__class__}``, ``{q[0]}``), conversions (``!r``) and format specs (``:>1000000``,
    which can allocate without bound) are errors; ``{{`` and ``}}`` are literal braces."""
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as error:
        raise SurgeryConfigError(f"{where}.template: invalid template {template!r}: {error}") from None
    names = []
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        if name == "" or name.isdigit():
            raise SurgeryConfigError(
                f"{where}.template: template {template!r} has a positional placeholder {{{name}}}; name a field, "
                "e.g. {question}")
        if not _PLAIN_NAME.match(name) or spec or conversion:
            shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            raise SurgeryConfigError(
                f"{where}.template: placeholder {shown} is not a plain field name; a template may only name "
                "fields, like {question} (no attributes, indexes, conversions or format specs; {{ and }} are "
                "literal braces)")
        names.append(name)
    return names


def render_template(template: str, record: Mapping[str, Any], number: int, source: str, where: str) -> str:
    """``template`` with each ``{field}`` replaced by the record's value (str(), for numbers). Rendered
    piece by piece, never through ``str.format``, so nothing but the named values is evaluated."""
    fields = sorted(str(key) for key in record.keys())
    pieces = []
    for literal, name, _, _ in string.Formatter().parse(template):
        pieces.append(literal)
        if name is None:
            continue
        if name not in record:
            raise SurgeryConfigError(
                f"{where}.template: unknown placeholder {{{name}}} in template {template!r}; the records of "
                f"{source} have the fields {fields} (use {{{{ and }}}} for literal braces)")
        value = record[name]
        if value is None:
            continue
        if not isinstance(value, _SCALARS) or isinstance(value, bool):
            raise SurgeryConfigError(
                f"{where}.template: record {number} of {source}: field {name!r} holds {type(value).__name__} "
                f"{_preview(value)}, not text or a number; name a text field in the template")
        pieces.append(str(value))
    return "".join(pieces)


def longest_token_chars(tokenizer) -> int:
    """How many characters one token of ``tokenizer`` can cover at most (its longest vocabulary entry:
    byte-level and SentencePiece entries spell one character per covered character or byte)."""
    if tokenizer is None:
        return FALLBACK_TOKEN_CHARS
    try:
        return max(1, max(len(token) for token in tokenizer.get_vocab()))
    except Exception:  # noqa: BLE001 - a tokenizer without a readable vocabulary
        return FALLBACK_TOKEN_CHARS


def truncate_for_positions(texts: Sequence[str], max_positions: int, tokenizer=None,
                           token_chars: Optional[int] = None) -> Tuple[List[str], int]:
    """``texts`` with each one cut to what ``max_positions`` tokens can use, before anything tokenizes
    them (a 30 MB single-line record took minutes and GBs per tokenization). The cut keeps twice the
    characters the first ``max_positions + 1`` tokens can cover, at a whitespace where there is one,
    so the tokens capture keeps are the same and a cut text is still counted as truncated. Returns
    (texts, how many were cut)."""
    per_token = token_chars or longest_token_chars(tokenizer)
    budget = 2 * (max_positions + 1) * per_token
    out, cut = [], 0
    for text in texts:
        if isinstance(text, str) and len(text) > budget:
            space = text.rfind(" ", budget // 2, budget)
            text = text[:space if space > 0 else budget]
            cut += 1
        out.append(text)
    return out, cut
