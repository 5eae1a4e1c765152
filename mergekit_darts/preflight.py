"""Checks that need no training, run before mergekit starts: a typo must cost seconds, not a merge.

mergekit's own validation comes first (schema, merge method, the models' architectures); then the
output folder (writable, switchable, none of the inputs), the calibration sources (file exists,
field exists, enough records, texts that tokenize), every expert's config and tokenizer against the
model the merge will produce, the chat template, what ``synthesize`` would cost and the split sizes
that lr choice and early stopping need (docs/reliability.md lists them).
"""

import logging
from typing import Dict, List, Optional

from mergekit_darts.config import SurgeryConfig, SurgeryConfigError, format_validation_error
from mergekit_darts.errors import DeviceError, FormatError, MergeConfigError, first_line
from mergekit_darts.model_paths import check_local_model, check_merge_model_paths
from mergekit_darts.presets import continuation_warning, fit_preset
from mergekit_darts.output.destination import (check_not_an_input, check_output_writable, merge_inputs,
                                               surgery_inputs)
from mergekit_darts.preflight_counts import (check_continuation_room, check_selection_prompts, check_synthesis_cost,
                                             check_train_blocks, resolved_max_positions)
from mergekit_darts.preflight_weights import check_weight_files, merged_layer_sources
from mergekit_darts.settings import RunSettings

LOG = logging.getLogger(__name__)


def merge_config_error(error: BaseException) -> MergeConfigError:
    """mergekit's refusal of its part of the config, as one line naming the field where it can."""
    from pydantic import ValidationError

    if isinstance(error, ValidationError):
        return MergeConfigError(format_validation_error(error, "config"))
    return MergeConfigError(f"config: mergekit refuses the merge part: {first_line(error)}")


def check_merge_config(merge_part: dict, options, merge_config=None):
    """mergekit's own validation before anything of ours: its schema (``models``/``slices``), the merge
    method, and the referenced models' architectures. Returns the MergeConfiguration."""
    from mergekit import merge_methods
    from mergekit.architecture import get_architecture_info
    from mergekit.config import MergeConfiguration

    try:
        if merge_config is None:
            merge_config = MergeConfiguration.model_validate(merge_part)
    except Exception as error:  # noqa: BLE001 - pydantic errors and mergekit's RuntimeErrors alike
        raise merge_config_error(error) from None
    # a mistyped local folder is one line naming the field, not a Hub lookup (docs/reliability.md)
    check_merge_model_paths(merge_part)
    names = sorted(method.spec.name for method in merge_methods.registered_methods())
    if merge_config.merge_method not in names:
        raise MergeConfigError(f"config.merge_method: mergekit has no merge method {merge_config.merge_method!r}; "
                               f"choose one of {', '.join(names)}")
    try:
        get_architecture_info(merge_config, options)
    except Exception as error:  # noqa: BLE001 - a model mergekit cannot read, mixed architectures, ...
        raise merge_config_error(error) from None
    return merge_config


def load_model_config(path: str, where: str, trust_remote_code: bool):
    from transformers import AutoConfig

    check_local_model(path, where)  # "no such directory", not transformers' Hub-id error
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as error:  # transformers raises OSError/ValueError/HTTP errors alike
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SurgeryConfigError(
            f"{where}: cannot load a model config from {path!r} ({first_line}); give a local model "
            "directory or a Hub id that is available offline"
        ) from None


def _layers(config) -> Optional[int]:
    """The decoder layers a model config gives (its text config's, for a multimodal one)."""
    layers = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config,
                     "num_hidden_layers", None)
    return layers if isinstance(layers, int) else None


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
    surgery = fit_preset(surgery, hidden_size=hidden, log=False)[0]  # a preset's own ranks fit (said after the merge)
    ranks = ("rank", "head_rank") + (("depth_rank",) if surgery.depth != 0 else ())  # block adapters too
    for field in ranks:
        if getattr(surgery, field) > hidden:
            raise SurgeryConfigError(
                f"surgery.{field}: {getattr(surgery, field)} exceeds the merged model's "
                f"hidden size {hidden}; a rank above the hidden size adds parameters but no capacity"
            )
    layers = getattr(reference, "num_hidden_layers", None)
    if isinstance(layers, int) and isinstance(surgery.depth, int) and surgery.depth > layers:
        raise SurgeryConfigError(
            f"surgery.depth: {surgery.depth} exceeds the merged model's {layers} decoder layers ({reference_name}); "
            f"use at most depth: {layers}")
    check_train_blocks(surgery, layers, reference_name)
    check_continuation_room(surgery, *resolved_max_positions(surgery, reference))
    # only a written value: the default is the model's context when that is shorter (pipeline.resolve_from_model)
    if "max_positions" in surgery.model_fields_set and \
            surgery.max_positions > getattr(reference, "max_position_embeddings", surgery.max_positions):
        LOG.warning("surgery.max_positions=%d exceeds the model's max_position_embeddings=%d",
                    surgery.max_positions, reference.max_position_embeddings)
    for name, domain in surgery.domains.items():
        where = f"surgery.domains.{name}.model"
        expert = load_model_config(domain.model, where, trust_remote_code)
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
        writer = domain.calibration.synthesize_writer
        if writer is not None:  # it writes prompts read with the merged tokenizer: the same vocabulary
            where = f"surgery.domains.{name}.calibration.synthesize_writer"
            config = load_model_config(writer, where, trust_remote_code)
            if check_vocab and config.vocab_size != reference.vocab_size:
                raise SurgeryConfigError(
                    f"{where}: {writer!r} has vocabulary size {config.vocab_size} but the merged model has "
                    f"{reference.vocab_size}; use a model of the same family, e.g. the merge's base model")


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


def _load_tokenizer(path: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as error:  # noqa: BLE001 - no tokenizer files: capture uses the merged model's anyway
        LOG.debug("no tokenizer loadable from %s (%s)", path, error)
        return None


def check_tokenizers(surgery: SurgeryConfig, reference_path: str, trust_remote_code: bool, reference=None):
    """The merged model's tokenizer (the base model's, as mergekit copies it) against each expert's:
    surgery compares hidden states token by token, so a different vocabulary makes the targets
    meaningless. Returns the reference tokenizer (or None when it cannot be loaded)."""
    reference = reference if reference is not None else _load_tokenizer(reference_path, trust_remote_code)
    if reference is None:
        return None
    vocab = reference.get_vocab()
    for name, domain in surgery.domains.items():
        checked = [(f"surgery.domains.{name}.model", f"expert {domain.model!r}", domain.model)]
        if domain.calibration.synthesize_writer is not None:
            writer = domain.calibration.synthesize_writer
            checked.append((f"surgery.domains.{name}.calibration.synthesize_writer", repr(writer), writer))
        for where, what, path in checked:
            other = _load_tokenizer(path, trust_remote_code)
            if other is None and where.endswith("synthesize_writer"):  # it writes with its own tokenizer
                raise SurgeryConfigError(
                    f"{where}: no tokenizer can be loaded from {path!r}; the writer generates prompts with its own "
                    "tokenizer: add its tokenizer files, or use a model that has them (e.g. the merge's base model)")
            if other is None:
                continue
            other = other.get_vocab()
            if other != vocab:
                differing = len(set(vocab.items()) ^ set(other.items()))
                raise SurgeryConfigError(
                    f"{where}: {what} has a different tokenizer than the merged model ({len(other)} vs "
                    f"{len(vocab)} tokens, {differing} token ids differ); it must share the merged model's tokenizer"
                )
    return reference


def check_texts_usable(texts: Dict[str, List[str]], tokenizer,
                       add_special_tokens: Optional[Dict[str, bool]] = None) -> Dict[str, int]:
    """Each domain keeps at least one text that is not empty/null and has a token that is not a special
    one (``<unk>``, BOS, ...): what capture keeps. Returns the usable prompts per domain."""
    usable_counts = {}
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
        usable_counts[name] = len(non_empty)
        if tokenizer is None:
            continue
        special = set(tokenizer.all_special_ids)
        special_tokens = (add_special_tokens or {}).get(name, True)
        usable = 0
        for text in non_empty:
            try:
                ids = tokenizer(text, add_special_tokens=special_tokens)["input_ids"]
            except Exception:  # noqa: BLE001 - e.g. lone surrogates the Rust tokenizer refuses
                continue
            usable += any(token not in special for token in ids)
        if usable == 0:
            raise SurgeryConfigError(
                f"{where}: none of the {len(non_empty)} texts has a token the merged model's tokenizer knows (all "
                "unencodable or out of vocabulary: only special tokens such as <unk>); check the calibration data"
            )
        usable_counts[name] = usable
    return usable_counts


def check_chat_templates(surgery: SurgeryConfig, texts: Dict[str, List[str]], tokenizer) -> Dict[str, List[str]]:
    """``chat_template: true`` needs a tokenizer with a chat template: rendered now with the merged
    model's tokenizer (the base model's, which mergekit copies, with the template of mergekit's own
    ``chat_template:`` key when the config has one: ``merged_chat_template``), so a missing or failing template
    stops the run before the merge. Returns the texts as capture will tokenize them."""
    from mergekit_darts.repair.capture.calibration import apply_chat_template

    rendered = dict(texts)
    sources = [(f"surgery.domains.{name}.calibration", domain.calibration, name)
               for name, domain in surgery.domains.items()]
    if surgery.router_eval is not None:
        sources.append(("surgery.router_eval", surgery.router_eval, None))
    for where, calibration, name in sources:
        if not calibration.chat_template or tokenizer is None:
            continue
        sample = texts[name] if name is not None else ["a prompt"]
        try:
            wrapped = apply_chat_template(sample, tokenizer, where=f"{where}.chat_template")
        except SurgeryConfigError:
            raise
        except Exception as error:  # noqa: BLE001 - a template that fails to render (jinja errors, ...)
            raise SurgeryConfigError(f"{where}.chat_template: the merged model's chat template fails to render "
                                     f"({first_line(error)}); set chat_template: false or fix the template") from None
        if name is not None:
            rendered[name] = wrapped
    return rendered


def truncate_texts(surgery: SurgeryConfig, texts: Dict[str, List[str]], tokenizer) -> Dict[str, List[str]]:
    """Each text cut to what max_positions can use, before the first tokenization (calibration_text)."""
    from mergekit_darts.calibration_text import longest_token_chars, truncate_for_positions

    per_token = longest_token_chars(tokenizer)
    out = {}
    for name, domain_texts in texts.items():
        out[name], cut = truncate_for_positions(domain_texts, surgery.max_positions, token_chars=per_token)
        if cut:
            LOG.info("surgery.domains.%s.calibration: %d text(s) longer than max_positions=%d can use were cut "
                     "before tokenizing", name, cut, surgery.max_positions)
    return out


def _merged_tokenizer(merge_config, options, base_path: str, trust_remote_code: bool):
    """The tokenizer the merge will have (mergekit copies the base model's): None when a tokenizer:
    block changes it (capture checks it then). Its absence is an error: surgery tokenizes with it."""
    if getattr(merge_config, "tokenizer", None) or getattr(merge_config, "tokenizer_source", None):
        return None
    if options is not None and getattr(options, "copy_tokenizer", True) is False:
        raise SurgeryConfigError("surgery: --no-copy-tokenizer leaves the merge without a tokenizer, which surgery "
                                 "tokenizes its calibration texts with; drop --no-copy-tokenizer")
    tokenizer = _load_tokenizer(base_path, trust_remote_code)
    if tokenizer is None:
        raise SurgeryConfigError(
            f"base_model: no tokenizer can be loaded from {base_path!r}; mergekit copies the base model's tokenizer "
            "into the merge and surgery tokenizes with it: add its tokenizer files, or set tokenizer_source")
    return tokenizer


def merged_chat_template(surgery: SurgeryConfig, merge_config, tokenizer, trust_remote_code: bool):
    """``tokenizer`` (the base model's, which mergekit copies) with the chat template that mergekit's own
    ``chat_template:`` key gives the merge (a named one, a Jinja string, or ``auto``: the most common one
    among the merge's models), set the way mergekit sets it, so that ``chat_template: true`` in a
    calibration is checked against the template the merge will have."""
    key = getattr(merge_config, "chat_template", None)
    if not key or tokenizer is None:
        return tokenizer
    try:
        from mergekit.merge import _set_chat_template  # the function mergekit calls on the merge's tokenizer
    except ImportError:  # another mergekit: the template is checked after the merge, when capture renders it
        return None
    before = tokenizer.chat_template
    try:
        _set_chat_template(tokenizer, merge_config, trust_remote_code=trust_remote_code)
    except Exception as error:  # noqa: BLE001 - mergekit's RuntimeError("Invalid chat template: ...")
        raise MergeConfigError(f"config.chat_template: mergekit refuses {key!r} ({first_line(error)}); name one of "
                               "its templates (chatml, llama3, mistral, alpaca, exaone), auto or a Jinja string") from None
    users = [name for name, domain in surgery.domains.items() if domain.calibration.chat_template]
    if key == "auto" and users and not tokenizer.chat_template and not before:
        raise SurgeryConfigError(
            f"surgery.domains.{users[0]}.calibration.chat_template: the merge's chat_template: auto finds no chat "
            "template in any of its models' tokenizers; name one in config.chat_template (e.g. chatml or llama3) or "
            "set chat_template: false")
    return tokenizer


def _check_texts(surgery: SurgeryConfig, texts, tokenizer):
    """Truncation, chat templates, usable tokens and split sizes; returns the (cut) texts for capture."""
    warning = continuation_warning(surgery)
    if warning:
        LOG.warning(warning)
    texts = truncate_texts(surgery, texts, tokenizer)
    rendered = check_chat_templates(surgery, texts, tokenizer)
    plain = {name: not domain.calibration.chat_template for name, domain in surgery.domains.items()}
    usable = check_texts_usable(rendered, tokenizer, plain)
    check_synthesis_cost(surgery, usable)
    check_selection_prompts(surgery, usable)
    return texts


def check_before_merge(surgery: SurgeryConfig, merge_config, settings: RunSettings,
                       out_path: Optional[str] = None, options=None) -> Dict[str, List[str]]:
    """Everything checkable before ``run_merge`` (after ``check_merge_config``): device, output folder,
    calibration data, expert configs and tokenizers, chat templates, split sizes. Returns the
    calibration texts per domain (before any chat template), cut to what max_positions can use."""
    trust_remote_code = settings.trust_remote_code
    check_device(settings)
    if out_path is not None:
        check_output_writable(out_path)
        inputs = {**merge_inputs(merge_config), **surgery_inputs(surgery)}  # the surgery field names win
        check_not_an_input(out_path, [(field, path) for path, field in inputs.items()])
    texts = _check_calibration(surgery, settings.seed)
    base = merge_config.base_model
    if base is None:
        models = merge_config.referenced_models()
        if not models:
            raise SurgeryConfigError("config: the merge references no models")
        base = models[0]
    reference = load_model_config(str(base.model.path), "base_model", trust_remote_code)
    tokenizer = _merged_tokenizer(merge_config, options, str(base.model.path), trust_remote_code)
    # a tokenizer: / tokenizer_source: block can change the merged vocabulary: capture checks it then
    vocab_changes = tokenizer is None
    _check_experts(surgery, reference, str(base.model.path), trust_remote_code, check_vocab=not vocab_changes)
    check_weight_files(surgery, merged_layer_sources(merge_config, str(base.model.path), _layers(reference)))
    if not vocab_changes:
        check_tokenizers(surgery, str(base.model.path), trust_remote_code, reference=tokenizer)
    tokenizer = merged_chat_template(surgery, merge_config, tokenizer, trust_remote_code)
    return _check_texts(surgery, texts, tokenizer)


def check_surgery(surgery: SurgeryConfig, merged_config_path: str, settings: RunSettings) -> Dict[str, List[str]]:
    """The same checks against an existing merged directory (surgery-only runs, in place)."""
    trust_remote_code = settings.trust_remote_code
    check_device(settings)
    check_output_writable(merged_config_path, where="merged model directory", switched_in=False)
    check_not_an_input(merged_config_path, [(field, path) for path, field in surgery_inputs(surgery).items()
                                            if not field.endswith("cache_dir")],
                       where="merged model directory", replaced_whole=False)
    texts = _check_calibration(surgery, settings.seed)
    reference = load_model_config(merged_config_path, "merged model", trust_remote_code)
    _check_experts(surgery, reference, merged_config_path, trust_remote_code)
    layers = _layers(reference)
    check_weight_files(surgery, [(merged_config_path, i) for i in range(layers)] if layers else None,
                       merged_label="the merged model")
    tokenizer = check_tokenizers(surgery, merged_config_path, trust_remote_code)
    if tokenizer is None:
        raise SurgeryConfigError(f"merged model directory {merged_config_path!r}: no tokenizer can be loaded from "
                                 "it; surgery tokenizes with the merged model's tokenizer: copy the base model's in")
    return _check_texts(surgery, texts, tokenizer)
