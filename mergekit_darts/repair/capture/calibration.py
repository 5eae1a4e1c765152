"""Calibration prompts of a domain: records -> deterministic sample -> templated raw texts.

A ``calibration:`` entry (``CalibrationConfig``) names exactly one source: a local file (``path``),
inline ``texts`` or a Hugging Face ``dataset``. Every error names its YAML path (``where``) and says
what to do, because this runs in the pre-merge validation: a bad calibration file should fail
before minutes of merging, not after. Chat templating is separate (``apply_chat_template``) since it
needs the merged model's tokenizer, which only exists after the merge.
"""

import csv
import json
import logging
import os
import random
import re
from typing import Any, Dict, List, Sequence

from mergekit_darts.calibration_text import field_text, render_template, template_fields
from mergekit_darts.config import CalibrationConfig, SurgeryConfigError
from mergekit_darts.extras import install_command

LOG = logging.getLogger(__name__)

# Text-only sources (.txt lines, inline ``texts``) become records with this single field, so a
# ``template`` can refer to it as ``{text}``.
TEXT_FIELD = "text"
FORMATS = (".jsonl", ".ndjson", ".json", ".txt", ".parquet", ".csv")


def load_calibration_texts(cal: CalibrationConfig, seed: int, where: str = "calibration") -> List[str]:
    """The domain's calibration texts: records -> ``samples`` of them (seeded) -> ``template``.

    No chat template is applied here (see ``apply_chat_template``). Raises SurgeryConfigError
    with messages prefixed by ``where`` (e.g. ``surgery.domains.math.calibration``).
    """
    if cal.path is not None:
        records, source, text_only = _read_file(cal, where), repr(cal.path), cal.path.lower().endswith(".txt")
    elif cal.texts is not None:
        records, source, text_only = [{TEXT_FIELD: t} for t in cal.texts], "'texts'", True
    else:
        records, source, text_only = _load_dataset(cal, where), f"dataset {cal.dataset!r}", False

    if len(records) == 0:
        raise SurgeryConfigError(f"{where}: {source} is empty (no records); give a file with at least one sample")
    if cal.template is None and not text_only:
        _check_field(records, cal.field, source, where)

    indices = _sample_indices(len(records), cal.samples, seed, source, where)
    if cal.template is not None:
        template_fields(cal.template, where)  # only plain field names: nothing else is evaluated
        return [render_template(cal.template, records[i], i + 1, source, where) for i in indices]
    field = TEXT_FIELD if text_only else cal.field
    return [field_text(records[i][field], field, i + 1, source, where) for i in indices]


def apply_chat_template(texts: Sequence[str], tokenizer, where: str = "calibration.chat_template") -> List[str]:
    """Wrap each text as one user turn, rendered exactly as the model sees it at inference.

    ``add_generation_prompt=True`` so the captured positions end where the assistant's answer
    starts. The rendered text already holds the template's special tokens (e.g. BOS): tokenize it
    with ``add_special_tokens=False``.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise SurgeryConfigError(
            f"{where}: the merged model's tokenizer has no chat template (mergekit copies the base model's); give "
            "the merge one with mergekit's own chat_template: key (auto: the most common template of the merge's "
            "models, or a named one such as llama3 or chatml), or set 'chat_template: false' and use a 'template:' "
            "string instead"
        )
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        for text in texts
    ]


# --- sources ---------------------------------------------------------------------------------


def _read_file(cal: CalibrationConfig, where: str) -> List[Dict[str, Any]]:
    path = os.path.expanduser(cal.path)
    if os.path.isdir(path):
        raise SurgeryConfigError(f"{where}.path: {cal.path!r} is a directory; give one file ({', '.join(FORMATS)})")
    if not os.path.isfile(path):
        raise SurgeryConfigError(
            f"{where}.path: no such file {cal.path!r} (relative paths are relative to the current "
            f"directory {os.getcwd()!r}); check the path"
        )
    ext = next((e for e in FORMATS if path.lower().endswith(e)), None)
    if ext is None:
        raise SurgeryConfigError(
            f"{where}.path: unsupported file type {cal.path!r}; use one of {', '.join(FORMATS)}"
        )
    try:
        if ext in (".jsonl", ".ndjson"):
            return _read_jsonl(path, cal.path, where)
        if ext == ".json":
            return _read_json(path, cal.path, where)
        if ext == ".txt":
            return _read_txt(path, cal.separator)
        if ext == ".csv":
            with open(path, newline="", encoding="utf-8") as handle:
                return list(csv.DictReader(handle))
        import pyarrow.parquet as pq  # optional dependency (mergekit-darts[data])

        return pq.read_table(path).to_pylist()
    except SurgeryConfigError:
        raise
    except ImportError as error:
        raise SurgeryConfigError(
            f"{where}.path: reading {cal.path!r} needs {error.name}, in the [data] extra: {install_command('data')}"
        ) from None
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise SurgeryConfigError(f"{where}.path: cannot read {cal.path!r}: {error}") from None


def _read_jsonl(path: str, shown: str, where: str) -> List[Dict[str, Any]]:
    records = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise SurgeryConfigError(f"{where}.path: {shown!r} line {number} is not valid JSON: {error}") from None
            if not isinstance(record, dict):
                raise SurgeryConfigError(
                    f"{where}.path: {shown!r} line {number} is a {type(record).__name__}, expected a JSON "
                    "object like {\"text\": \"...\"}"
                )
            records.append(record)
    return records


def _read_json(path: str, shown: str, where: str) -> List[Dict[str, Any]]:
    with open(path, encoding="utf-8") as handle:
        try:
            data = json.load(handle)
        except json.JSONDecodeError as error:
            raise SurgeryConfigError(f"{where}.path: {shown!r} is not valid JSON: {error}") from None
    if not isinstance(data, list) or not all(isinstance(item, dict) for item in data):
        raise SurgeryConfigError(
            f"{where}.path: {shown!r} must hold a JSON list of objects like [{{\"text\": \"...\"}}]"
        )
    return data


def _read_txt(path: str, separator: str) -> List[Dict[str, Any]]:
    with open(path, encoding="utf-8") as handle:
        content = handle.read()
    if separator == "blank":  # multi-line samples separated by one or more blank lines
        chunks = re.split(r"\n[ \t\r]*\n", content.replace("\r\n", "\n"))
    else:
        chunks = content.splitlines()
    return [{TEXT_FIELD: chunk.strip("\r\n")} for chunk in chunks if chunk.strip()]


def _load_dataset(cal: CalibrationConfig, where: str):
    name = cal.dataset + (f" (subset {cal.subset!r})" if cal.subset else "") + f", split {cal.split!r}"
    try:
        import datasets  # optional dependency (mergekit-darts[data])
    except ImportError:
        raise SurgeryConfigError(
            f"{where}.dataset: loading {name} needs the 'datasets' package, in the [data] extra: {install_command('data')}"
        ) from None
    try:
        return datasets.load_dataset(cal.dataset, cal.subset, split=cal.split)
    except Exception as error:  # offline, not cached, unknown name/split: all end the same way
        offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
        raise SurgeryConfigError(
            f"{where}.dataset: cannot load {name}: {type(error).__name__}: {error}. The dataset must be in "
            "the local Hugging Face cache or reachable"
            + (" (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set)" if offline else "")
            + "; download it first, or export it to a .jsonl file and use 'path:'"
        ) from None


# --- records ---------------------------------------------------------------------------------


def _fields(record) -> List[str]:
    return sorted(str(key) for key in record.keys())


def _check_field(records, field: str, source: str, where: str) -> None:
    columns = getattr(records, "column_names", None)  # a datasets.Dataset: check its schema, not every row
    if columns is not None:
        if field not in columns:
            raise SurgeryConfigError(
                f"{where}.field: {source} has no field {field!r}; its fields are {sorted(columns)}. "
                "Set 'field:' to one of them"
            )
        return
    for number, record in enumerate(records, 1):
        if field not in record:
            raise SurgeryConfigError(
                f"{where}.field: record {number} of {source} has no field {field!r}; its fields are "
                f"{_fields(record)}. Set 'field:' to one of them"
            )


def _sample_indices(count: int, samples: int, seed, source: str, where: str) -> List[int]:
    if count < samples:
        LOG.warning("%s: %s has %d records, fewer than samples=%d; using all %d (set samples: %d to silence this)",
                    where, source, count, samples, count, count)
        return list(range(count))
    # A private generator: deterministic for a seed, independent of global random state.
    return sorted(random.Random(0 if seed is None else seed).sample(range(count), samples))
