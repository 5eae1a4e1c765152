"""Checks that need no training, run before mergekit starts: a typo must cost seconds, not a merge.

Calibration sources are loaded (file exists, field exists, enough records) and every expert's config
is compared with the model the merge will produce (hidden size, vocabulary, architecture).
"""

import logging
from typing import Dict, List

from mergekit_darts.config import SurgeryConfig, SurgeryConfigError
from mergekit_darts.errors import FormatError
from mergekit_darts.settings import RunSettings

LOG = logging.getLogger(__name__)


def _load_config(path: str, where: str, trust_remote_code: bool):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as error:  # transformers raises OSError/ValueError/HTTP errors alike
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SurgeryConfigError(
            f"{where}: cannot load a model config from {path!r} ({first_line}); give a local model "
            "directory or a Hub id that is available offline"
        ) from None


def _check_calibration(surgery: SurgeryConfig, seed: int) -> Dict[str, List[str]]:
    """Load every domain's calibration texts; they are handed on so the surgery reads them once."""
    from mergekit_darts.repair.calibration import load_calibration_texts

    if surgery.router_eval is not None:  # read again by the router step; loaded here to fail before merging
        load_calibration_texts(surgery.router_eval, seed, where="surgery.router_eval")
    return {
        name: load_calibration_texts(domain.calibration, seed, where=f"surgery.domains.{name}.calibration")
        for name, domain in surgery.domains.items()
    }


def _check_experts(surgery: SurgeryConfig, reference, reference_name: str, trust_remote_code: bool,
                   check_vocab: bool = True) -> None:
    from mergekit_darts.output.layout import plain_architecture

    try:
        plain_architecture({"architectures": getattr(reference, "architectures", None)})
    except FormatError as error:
        raise SurgeryConfigError(f"surgery: the merged model ({reference_name}): {error}") from None
    if surgery.max_positions > getattr(reference, "max_position_embeddings", surgery.max_positions):
        LOG.warning("surgery.max_positions=%d exceeds the model's max_position_embeddings=%d",
                    surgery.max_positions, reference.max_position_embeddings)
    for name, domain in surgery.domains.items():
        where = f"surgery.domains.{name}.model"
        expert = _load_config(domain.model, where, trust_remote_code)
        if expert.hidden_size != reference.hidden_size:
            raise SurgeryConfigError(
                f"{where}: expert {domain.model!r} has hidden size {expert.hidden_size} but the merged model "
                f"has {reference.hidden_size}; surgery needs experts of the merged model's family"
            )
        if check_vocab and expert.vocab_size != reference.vocab_size:
            raise SurgeryConfigError(
                f"{where}: expert {domain.model!r} has vocabulary size {expert.vocab_size} but the merged "
                f"model has {reference.vocab_size}; experts must share the merged model's tokenizer"
            )


def check_before_merge(surgery: SurgeryConfig, merge_config, settings: RunSettings) -> Dict[str, List[str]]:
    """Everything checkable before ``run_merge``: calibration data and expert configs.
    Returns the calibration texts per domain (before any chat template)."""
    trust_remote_code = settings.trust_remote_code
    texts = _check_calibration(surgery, settings.seed)
    base = merge_config.base_model
    if base is None:
        models = merge_config.referenced_models()
        if not models:
            raise SurgeryConfigError("config: the merge references no models")
        base = models[0]
    reference = _load_config(str(base.model.path), "base_model", trust_remote_code)
    # a tokenizer: / tokenizer_source: block can change the merged vocabulary: capture checks it then
    vocab_changes = bool(getattr(merge_config, "tokenizer", None) or getattr(merge_config, "tokenizer_source", None))
    _check_experts(surgery, reference, str(base.model.path), trust_remote_code, check_vocab=not vocab_changes)
    return texts


def check_surgery(surgery: SurgeryConfig, merged_config_path: str, settings: RunSettings) -> Dict[str, List[str]]:
    """The same checks against an existing merged directory (surgery-only runs)."""
    trust_remote_code = settings.trust_remote_code
    texts = _check_calibration(surgery, settings.seed)
    reference = _load_config(merged_config_path, "merged model", trust_remote_code)
    _check_experts(surgery, reference, merged_config_path, trust_remote_code)
    return texts

