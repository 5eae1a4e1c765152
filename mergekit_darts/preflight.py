"""Checks that need no training, run before mergekit starts: a typo must cost seconds, not a merge.

Calibration sources are loaded (file exists, field exists, enough records) and every expert's config
is compared with the model the merge will produce (hidden size, vocabulary, architecture).
"""

import logging
import os
import tempfile
from typing import Dict, List, Optional

from mergekit_darts.config import SurgeryConfig, SurgeryConfigError
from mergekit_darts.errors import DeviceError, FormatError
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
    from mergekit_darts.repair.capture.calibration import load_calibration_texts

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
        reference_arch = plain_architecture({"architectures": getattr(reference, "architectures", None)})
    except FormatError as error:
        raise SurgeryConfigError(f"surgery: the merged model ({reference_name}): {error}") from None
    hidden = reference.hidden_size
    for field in ("rank", "head_rank"):
        if getattr(surgery, field) > hidden:
            raise SurgeryConfigError(
                f"surgery.{field}: {getattr(surgery, field)} exceeds the merged model's hidden size {hidden}; "
                "a rank above the hidden size adds parameters but no capacity"
            )
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
        expert_archs = getattr(expert, "architectures", None) or []
        if expert_archs and expert_archs[0] != reference_arch and \
                expert_archs[0] != "Darts" + reference_arch:
            raise SurgeryConfigError(
                f"{where}: expert {domain.model!r} is a {expert_archs[0]} but the merged model is a "
                f"{reference_arch}; surgery needs experts of the merged model's architecture"
            )
        if check_vocab and expert.vocab_size != reference.vocab_size:
            raise SurgeryConfigError(
                f"{where}: expert {domain.model!r} has vocabulary size {expert.vocab_size} but the merged "
                f"model has {reference.vocab_size}; experts must share the merged model's tokenizer"
            )


def check_device(settings: RunSettings) -> None:
    """The requested device exists here (``device: cuda`` on a CPU machine fails now, not after the merge)."""
    if settings.device in ("auto", "cpu"):
        return
    import torch

    device = torch.device(settings.device)
    where = "surgery.device (or mergekit's --cuda/--device)"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"{where}: {settings.device!r} was requested but CUDA is not available on this "
                              "machine; use device: auto or cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(f"{where}: {settings.device!r} was requested but this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"{where}: 'mps' was requested but MPS is not available; use device: auto or cpu")


def check_output_writable(out_path: str, where: str = "output directory") -> None:
    """``out_path`` (if it exists) and the folder it is created in accept a new file: a real write probe,
    since ``os.access`` answers yes to root on a read-only mount point's permissions."""
    path = os.path.abspath(out_path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise SurgeryConfigError(f"{where} {out_path!r}: exists and is not a directory")
    parent = os.path.dirname(path)
    while parent and not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    for folder in ([path] if os.path.isdir(path) else []) + [parent]:
        try:
            handle, probe = tempfile.mkstemp(prefix=".darts-write-probe-", dir=folder)
            os.close(handle)
            os.remove(probe)
        except OSError as error:
            raise SurgeryConfigError(
                f"{where} {out_path!r}: cannot write into {folder!r} ({error.strerror or error}); choose a "
                "writable output directory"
            ) from None


def _load_tokenizer(path: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as error:  # noqa: BLE001 - no tokenizer files: capture uses the merged model's anyway
        LOG.debug("no tokenizer loadable from %s (%s)", path, error)
        return None


def check_tokenizers(surgery: SurgeryConfig, reference_path: str, trust_remote_code: bool):
    """The merged model's tokenizer (the base model's, as mergekit copies it) against each expert's:
    surgery compares hidden states token by token, so a different vocabulary makes the targets
    meaningless. Returns the reference tokenizer (or None when it cannot be loaded)."""
    reference = _load_tokenizer(reference_path, trust_remote_code)
    if reference is None:
        return None
    vocab = reference.get_vocab()
    for name, domain in surgery.domains.items():
        expert = _load_tokenizer(domain.model, trust_remote_code)
        if expert is None:
            continue
        other = expert.get_vocab()
        if other != vocab:
            differing = len(set(vocab.items()) ^ set(other.items()))
            raise SurgeryConfigError(
                f"surgery.domains.{name}.model: expert {domain.model!r} has a different tokenizer than the merged "
                f"model ({len(other)} vs {len(vocab)} tokens, {differing} token ids differ); experts must share "
                "the merged model's tokenizer"
            )
    return reference


def check_texts_usable(texts: Dict[str, List[str]], tokenizer) -> None:
    """Each domain keeps at least one text that is not empty/null and encodes to at least one token."""
    for name, domain_texts in texts.items():
        where = f"surgery.domains.{name}.calibration"
        non_empty = [text for text in domain_texts if isinstance(text, str) and text.strip()]
        if not non_empty:
            raise SurgeryConfigError(
                f"{where}: all {len(domain_texts)} sampled texts are empty or null; check 'field', 'template' "
                "and the file's records"
            )
        if len(non_empty) < len(domain_texts):
            LOG.warning("%s: %d of %d sampled texts are empty or null; they are skipped", where,
                        len(domain_texts) - len(non_empty), len(domain_texts))
        if tokenizer is None:
            continue
        encodable = 0
        for text in non_empty:
            try:
                encodable += bool(tokenizer(text, add_special_tokens=False)["input_ids"])
            except Exception:  # noqa: BLE001 - e.g. lone surrogates the Rust tokenizer refuses
                continue
        if encodable == 0:
            raise SurgeryConfigError(
                f"{where}: none of the {len(non_empty)} texts encodes to a token with the merged model's "
                "tokenizer (unencodable characters?); check the calibration data"
            )


def warn_expert_is_output(surgery: SurgeryConfig, out_path: Optional[str]) -> None:
    if out_path is None:
        return
    target = os.path.realpath(out_path)
    for name, domain in surgery.domains.items():
        if os.path.realpath(domain.model) == target:
            LOG.warning(
                "surgery.domains.%s.model is the output directory %s itself: the expert is the model this run "
                "replaces (its previous contents), which is rarely intended", name, out_path)


def check_before_merge(surgery: SurgeryConfig, merge_config, settings: RunSettings,
                       out_path: Optional[str] = None) -> Dict[str, List[str]]:
    """Everything checkable before ``run_merge``: device, output folder, calibration data, expert
    configs and tokenizers. Returns the calibration texts per domain (before any chat template)."""
    trust_remote_code = settings.trust_remote_code
    check_device(settings)
    if out_path is not None:
        check_output_writable(out_path)
        warn_expert_is_output(surgery, out_path)
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
    tokenizer = None if vocab_changes else check_tokenizers(surgery, str(base.model.path), trust_remote_code)
    check_texts_usable(texts, tokenizer)
    return texts


def check_surgery(surgery: SurgeryConfig, merged_config_path: str, settings: RunSettings) -> Dict[str, List[str]]:
    """The same checks against an existing merged directory (surgery-only runs)."""
    trust_remote_code = settings.trust_remote_code
    check_device(settings)
    check_output_writable(merged_config_path, where="merged model directory")
    texts = _check_calibration(surgery, settings.seed)
    reference = _load_config(merged_config_path, "merged model", trust_remote_code)
    _check_experts(surgery, reference, merged_config_path, trust_remote_code)
    check_texts_usable(texts, check_tokenizers(surgery, merged_config_path, trust_remote_code))
    return texts

