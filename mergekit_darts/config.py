"""Pydantic schema of the ``surgery:`` block of a mergekit YAML (docs/design.md §2).

Defaults are the paper's. Unknown keys are errors, and every error names its path in the YAML
(``surgery.domains.math.calibration.samples: ...``) so a typo is caught before any merging starts.
"""

import re
from typing import Annotated, Any, Dict, FrozenSet, List, Literal, Optional, Union, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from mergekit_darts.errors import SurgeryConfigError, format_validation_error  # noqa: F401  (re-exported)
from mergekit_darts.presets import PRESETS, expand_preset, filled_keys, preset_settings  # noqa: F401  (re-exported)
from mergekit_darts.yaml_source import split_yaml  # noqa: F401  (re-exported: where configs are read)

# Each vocabulary is defined once, as a Literal; the tuples are derived from it.
Method = Literal["darts", "standard"]
Loss = Literal["ewl1", "l1", "mse", "ewmse", "cosine", "kl"]
Content = Literal["relu", "linear"]
Dtype = Literal["auto", "bfloat16", "float16", "float32"]
METHODS = get_args(Method)
LOSSES = get_args(Loss)
CONTENTS = get_args(Content)
DTYPES = get_args(Dtype)
Preset = Literal["paper", "best"]
DOMAIN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# "none" = plain merge, "auto" = routed, "router" = the router's tensors (darts.router.*)
RESERVED_NAMES = ("none", "auto", "router")
DeviceMapStrategy = Literal["auto", "balanced", "balanced_low_0", "sequential"]
KLTarget = Literal["exact", "topk", "bf16"]
KLPrecision = Literal["float32", "mixed"]
RouterKind = Literal["auto", "centroid", "logistic"]
# what the router reads (docs/routing.md): the plain merged model's final states (with depth: a separate
# uncorrected pass over the prompt) or the first adapted block's input (no extra pass)
RouterStates = Literal["final", "block_input"]
AdapterInit = Literal["zero", "delta"]
ExtractFit = Literal["weights", "activations"]
_MAP_DEVICE = re.compile(r"^(cpu|disk|mps|cuda:\d+)$")
_MEMORY_KEY = re.compile(r"^(cpu|disk|mps|cuda:\d+|\d+)$")
_MEMORY_SIZE = re.compile(r"^\d+(\.\d+)?\s*([KMGT]i?B|B)$", re.IGNORECASE)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _yaml_float(value: Any) -> Any:
    """Floats as YAML writes them: PyYAML reads ``1e-3`` (no dot) as a string, so a string that is a
    number is accepted; a boolean (``lr: true`` would otherwise become 1.0) is not."""
    if isinstance(value, bool):
        raise ValueError("expected a number, got a boolean")
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"expected a number, got {value!r}") from None
    return value


# Strict ints: YAML's `rank: true` or `seed: 1e25` (a float) must be errors, not 1 / 10**25.
StrictInt = Annotated[int, Field(strict=True)]
YamlFloat = Annotated[float, BeforeValidator(_yaml_float), Field(strict=True)]

# Upper bounds (docs/reliability.md): far above any real use, low enough that a typo (1e9) is an
# error instead of a multi-GB allocation. The pre-merge checks also bound rank by the hidden size.
MAX_RANK = 65536  # no released model has a hidden size above this
MAX_POSITIONS = 131072  # 128k: the longest context window of common open models
MAX_STEPS = 10_000_000
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed's signed 64-bit range
MAX_BATCH = 1 << 20
MAX_DEPTH = 1024  # decoder layers: more than any released model has
# An Adam step moves each parameter by up to lr: above 10 the first step already dwarfs every hidden
# state (measured: lr 10 makes the tiny models' held-out bias 20000x worse); useful values are 1e-4..1e-1.
MAX_LR = 10.0


def _module_attribute_names() -> frozenset:
    """Names a domain cannot have: the emitted model keeps domains in an ``nn.ModuleDict``, which
    refuses keys that are attributes (``keys``, ``forward``, ``training``, ...). Taken from the
    installed torch, so a newer torch's attributes are covered too."""
    import torch.nn

    return frozenset(dir(torch.nn.ModuleDict()))


class CalibrationConfig(_Strict):
    """Where a domain's calibration prompts come from: exactly one of path / texts / dataset."""

    path: Optional[str] = None
    texts: Optional[List[str]] = None
    dataset: Optional[str] = None
    subset: Optional[str] = None
    split: str = "train"
    field: str = "text"
    separator: Literal["line", "blank"] = "line"
    samples: StrictInt = Field(50, gt=0, le=100_000_000)
    template: Optional[str] = None
    chat_template: bool = Field(False, strict=True)
    continue_tokens: StrictInt = Field(0, ge=0, le=MAX_POSITIONS)
    # quality options (docs/quality.md): sampled continuations of each prompt besides the greedy one
    continue_samples: StrictInt = Field(0, ge=0, le=1024)
    continue_temperature: YamlFloat = Field(1.0, gt=0, allow_inf_nan=False)
    # prompts the expert writes from the training prompts, then answers like the user's (docs/quality.md)
    synthesize: StrictInt = Field(0, ge=0, le=10_000_000)
    synthesize_temperature: YamlFloat = Field(1.0, gt=0, allow_inf_nan=False)
    synthesize_writer: Optional[str] = None  # the model that writes them (None: the domain's expert)

    @model_validator(mode="after")
    def _writer_needs_synthesize(self):
        if self.synthesize_writer is not None and self.synthesize == 0:
            raise ValueError("synthesize_writer needs synthesize > 0 (how many prompts it writes)")
        return self

    @model_validator(mode="after")
    def _no_ignored_keys(self):
        """A key written in the YAML that this source would ignore is an error naming both keys."""
        given = self.model_fields_set
        source = "path" if self.path is not None else "texts" if self.texts is not None else "dataset"
        text_only = self.texts is not None or (self.path or "").lower().endswith(".txt")
        rules = [
            ("subset", source != "dataset", f"is read only for 'dataset', not '{source}'"),
            ("split", source != "dataset", f"is read only for 'dataset', not '{source}'"),
            ("separator", not (self.path or "").lower().endswith(".txt"), "splits only a .txt 'path'"),
            ("field", text_only, f"is not read for {'texts' if self.texts is not None else 'a .txt path'} "
             "(plain text: a template names it {text})"),
            ("field", self.template is not None, "is not read with 'template' (the template names the fields)"),
            ("continue_temperature", self.continue_samples == 0, "is used only with continue_samples > 0"),
            ("synthesize_temperature", self.synthesize == 0, "is used only with synthesize > 0"),
        ]
        for key, ignored, why in rules:
            if key in given and ignored:
                raise ValueError(f"'{key}' {why}; remove it")
        return self

    @model_validator(mode="after")
    def _samples_need_tokens(self):
        if self.continue_samples > 0 and self.continue_tokens == 0:
            raise ValueError("continue_samples needs continue_tokens > 0 (the length of each sampled continuation)")
        return self

    @model_validator(mode="after")
    def _one_source(self):
        given = [k for k in ("path", "texts", "dataset") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of 'path', 'texts' or 'dataset'"
                + (f" (got {', '.join(given)})" if given else "")
            )
        if self.texts is not None and not self.texts:
            raise ValueError("'texts' is empty")
        return self


class DomainConfig(_Strict):
    model: str
    calibration: CalibrationConfig


class SurgeryConfig(_Strict):
    method: Method = "darts"
    loss: Loss = "ewl1"
    content: Content = "relu"
    rank: StrictInt = Field(16, gt=0, le=MAX_RANK)
    head_rank: StrictInt = Field(0, ge=0, le=MAX_RANK)
    max_positions: StrictInt = Field(512, gt=0, le=MAX_POSITIONS)
    steps: StrictInt = Field(500, ge=0, le=MAX_STEPS)
    lr: YamlFloat = Field(1.0e-3, gt=0, le=MAX_LR, allow_inf_nan=False)
    batch_size: Optional[StrictInt] = Field(None, gt=0, le=MAX_BATCH)
    micro_batch_size: Optional[StrictInt] = Field(None, gt=0, le=MAX_BATCH)  # the same step in parts (memory)
    seed: Optional[StrictInt] = Field(None, ge=0, le=MAX_SEED)
    device: str = "auto"
    dtype: Dtype = "auto"
    held_out: YamlFloat = Field(0.2, ge=0, lt=1)
    capture_batch_size: StrictInt = Field(8, gt=0, le=MAX_BATCH)
    kl_chunk_size: StrictInt = Field(1024, gt=0, le=1 << 24)
    cache_dir: Optional[str] = None
    default_domain: Optional[str] = None
    domains: Dict[str, DomainConfig]
    # automatic domain routing (docs/routing.md)
    router: Optional[bool] = Field(None, strict=True)  # None: true when there are >= 2 domains
    # the gate: None = calibrated so that ~router_fallback_rate of in-domain prompts fall back to "none"
    router_threshold: Optional[YamlFloat] = Field(None, ge=0, le=1)
    router_fallback_rate: Optional[YamlFloat] = Field(None, ge=0, lt=1)  # None: 0.05 (docs/routing.md)
    router_kind: RouterKind = "auto"  # auto: centroid or logistic, whichever cross-validates better
    router_eval: Optional[CalibrationConfig] = None  # out-of-domain prompts to measure the fallback on
    router_states: RouterStates = "final"
    # A domain whose held-out metric got worse than the plain merge (or is not finite) is never made
    # the default silently: the model then loads as "none". True keeps default_domain regardless.
    allow_worse_default: bool = Field(False, strict=True)
    # each domain's trained correction against its untrained start (the extract / the identity) on the
    # validation split, else the held-out records: the better one ships (train/selection.py, keep_better)
    no_regret: bool = Field(True, strict=True)
    # scale (docs/scale.md): capture across devices (accelerate) and KL at the paper's scale.
    # The defaults keep the single-device capture and the exact float32 full-batch KL.
    device_map: Optional[Union[DeviceMapStrategy, Dict[str, Union[int, str]]]] = None
    max_memory: Optional[Dict[Union[int, str], Union[int, str]]] = None
    kl_target: KLTarget = "exact"
    kl_top_k: StrictInt = Field(256, gt=0, le=1 << 24)
    kl_precision: KLPrecision = "float32"
    kl_positions_per_step: Optional[StrictInt] = Field(None, gt=0, le=1 << 30)
    # quality options (docs/quality.md): presets, held-out selection, weight decay
    preset: Optional[Preset] = None
    weight_decay: YamlFloat = Field(0.0, ge=0, allow_inf_nan=False)
    lr_candidates: Optional[List[YamlFloat]] = None
    early_stopping: bool = Field(False, strict=True)
    eval_every: StrictInt = Field(25, gt=0, le=MAX_STEPS)
    patience: StrictInt = Field(8, gt=0, le=MAX_STEPS)
    validation: YamlFloat = Field(0.2, gt=0, lt=1)
    refit: bool = Field(True, strict=True)
    # adapters inside the merged model's last `depth` decoder blocks (0: the final state only),
    # rank `depth_rank`, trained from the blocks' cached input (docs/quality.md)
    depth: Union[Annotated[int, Field(strict=True, ge=0, le=MAX_DEPTH)], Literal["all"]] = 0  # "all": every block
    depth_rank: StrictInt = Field(8, gt=0, le=MAX_RANK)
    # block adapters / head correction start at zero, or at the SVD of expert - merge (train/delta_init.py)
    adapter_init: AdapterInit = "zero"
    # what the extract's truncated SVD approximates: the weight delta, or its outputs on the merge's inputs
    extract_fit: ExtractFit = "weights"
    train_blocks: Union[Annotated[int, Field(strict=True, ge=0, le=MAX_DEPTH)], Literal["all"], None] = None  # the last k adapted blocks train, the rest keep the extract
    # the keys the preset filled in, and what presets.fit_preset changed of them to fit the model and data
    _preset_filled: FrozenSet[str] = PrivateAttr(default=frozenset())
    _preset_fitted: Dict[str, Dict[str, Any]] = PrivateAttr(default_factory=dict)

    @field_validator("device_map")
    @classmethod
    def _device_map(cls, value):
        if isinstance(value, dict):
            if not value:
                raise ValueError("an explicit map needs at least one entry (module name -> device)")
            for module, device in value.items():
                if not (isinstance(device, int) and device >= 0) and not (
                        isinstance(device, str) and _MAP_DEVICE.match(device)):
                    raise ValueError(f"module {module!r}: unknown device {device!r}; use a GPU index, "
                                     "cuda:N, cpu, mps or disk")
        return value

    @field_validator("max_memory")
    @classmethod
    def _max_memory(cls, value):
        for device, size in (value or {}).items():
            if not _MEMORY_KEY.match(str(device)):
                raise ValueError(f"unknown device {device!r}; use a GPU index (0, 1, ...), cpu, mps or disk")
            if not ((isinstance(size, int) and size > 0) or (isinstance(size, str) and _MEMORY_SIZE.match(size.strip()))):
                raise ValueError(f"{device}: size {size!r} must be a byte count or like '20GiB' / '500MB'")
        return value

    @model_validator(mode="after")
    def _no_ignored_options(self):
        """An option this run would ignore is an error naming both keys (it was accepted silently)."""
        given = self.model_fields_set
        kl = self.loss == "kl"
        chooses = self.early_stopping or len(self.lr_candidates or ()) > 1
        rules = [
            ("head_rank", self.head_rank > 0 and not kl, "loss",
             f"the logit correction is trained only by loss: kl ('{self.loss}' never reaches it, so it would "
             "ship zeros); set loss: kl or head_rank: 0"),
            *[(key, not kl, "loss", f"{key} is used only with loss: kl (loss is '{self.loss}'); remove it or "
               "set loss: kl") for key in ("kl_target", "kl_precision", "kl_positions_per_step", "kl_top_k")],
            ("micro_batch_size", self.kl_positions_per_step is not None, "kl_positions_per_step",
             "kl_positions_per_step draws its positions from the whole batch, not per micro-batch; remove one of "
             "them (micro_batch_size saves memory without changing the step, kl_positions_per_step changes it)"),
            ("kl_top_k", kl and self.kl_target != "topk", "kl_target",
             f"kl_top_k is used only with kl_target: topk (kl_target is '{self.kl_target}')"),
            ("lr", self.lr_candidates is not None, "lr_candidates",
             "lr_candidates chooses the learning rate, so lr would be ignored; give one of them"),
            *[(key, not self.early_stopping, "early_stopping", f"{key} is used only with early_stopping: true")
              for key in ("eval_every", "patience")],
            *[(key, not chooses, "early_stopping/lr_candidates",
               f"{key} is used only when something is chosen on validation records (early_stopping: true or "
               "two or more lr_candidates)") for key in ("validation", "refit")],
            ("depth_rank", self.depth == 0, "depth", "depth_rank is used only with depth > 0"),
            ("adapter_init", self.adapter_init == "delta" and self.depth == 0 and self.head_rank == 0, "depth/head_rank",
             "adapter_init: delta starts the block adapters (depth > 0) and the head correction (head_rank > 0) "
             "from the expert's weight deltas, and this run has neither; set depth (e.g. depth: all)"),
            ("extract_fit", self.adapter_init != "delta", "adapter_init", "extract_fit chooses how the data-free "
             "extract that adapter_init: delta starts from is fitted; set adapter_init: delta"),
            ("train_blocks", self.depth == 0 or self.adapter_init != "delta", "depth/adapter_init", "train_blocks trains the "
             "last k adapted blocks from the data-free extract and keeps the extract below; it needs depth > 0 and adapter_init: delta"),
            ("train_blocks", isinstance(self.depth, int) and isinstance(self.train_blocks, int) and self.train_blocks > self.depth,
             "depth", f"train_blocks ({self.train_blocks}) exceeds the {self.depth} adapted block(s); use at most {self.depth}"),
            *[(key, not self.router_enabled, "router",
               f"{key} is used only with the router (router: true; it is off by default with one domain)")
              for key in ("router_threshold", "router_fallback_rate", "router_kind", "router_eval", "router_states")],
            ("router_states", self.router_states == "block_input" and self.depth == 0, "depth",
             "router_states: block_input reads the first adapted block's input, and depth is 0 (no block is "
             "adapted; the router reads the final states); set depth or remove router_states"),
            ("router_fallback_rate", self.router_threshold is not None, "router_threshold",
             "router_threshold fixes the gate, so the calibration to router_fallback_rate would be ignored; "
             "give one of them"),
        ]
        for key, ignored, other, why in rules:
            if key in given and ignored:
                raise ValueError(f"{key} together with {other}: {why}")
        return self

    @model_validator(mode="after")
    def _nothing_to_choose_without_steps(self):
        """At ``steps: 0`` every lr candidate and early-stopping point is the untrained start: a "choice"."""
        keys = " and ".join(k for k, on in (("early_stopping", self.early_stopping),
                                              ("lr_candidates", self.lr_candidates is not None)) if on)
        if self.steps == 0 and keys:
            raise ValueError(f"{keys} together with steps: 0: nothing is trained, so every candidate is the same "
                             f"untrained start and there is nothing to choose; remove {keys} or set steps > 0")
        return self

    @model_validator(mode="after")
    def _max_memory_needs_map(self):
        if self.max_memory is not None and self.device_map is None:
            raise ValueError("max_memory needs device_map (e.g. device_map: auto); it has no effect without one")
        return self

    @model_validator(mode="wrap")
    @classmethod
    def _expand_preset(cls, data: Any, handler) -> "SurgeryConfig":
        expanded = expand_preset(data)
        config = handler(expanded)
        if isinstance(data, dict):
            config._preset_filled = filled_keys(data, expanded)
        return config

    @field_validator("lr_candidates")
    @classmethod
    def _lr_candidates(cls, value: Optional[List[float]]) -> Optional[List[float]]:
        if value is not None and (not value or any(not 0 < lr <= MAX_LR for lr in value)):
            raise ValueError(f"give a non-empty list of learning rates, each > 0 and <= {MAX_LR:g}")
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if value != "auto" and not re.match(r"^(cpu|cuda(:\d+)?|mps)$", value):
            raise ValueError(f"unknown device {value!r}; use auto, cpu, cuda or cuda:N")
        return value

    @field_validator("domains")
    @classmethod
    def _domains(cls, value: Dict[str, DomainConfig]) -> Dict[str, DomainConfig]:
        if not value:
            raise ValueError("at least one domain is required")
        reserved = _module_attribute_names()
        for name in value:
            if name in RESERVED_NAMES or not DOMAIN_NAME.match(name):
                raise ValueError(
                    f"domain name {name!r} must be a Python-identifier-like name (letters, digits, _) "
                    f"and not one of {list(RESERVED_NAMES)}"
                )
            if name in reserved:
                raise ValueError(
                    f"domain name {name!r} is an attribute of torch's nn.ModuleDict, which holds the domains "
                    f"in the emitted model (it could not be loaded); rename it, e.g. {name + '_domain'!r}"
                )
        return value

    @model_validator(mode="after")
    def _default_domain(self):
        if self.default_domain == "auto":
            if not self.router_enabled:
                raise ValueError(
                    "default_domain 'auto' needs the router, but router is "
                    + ("false" if self.router is False else "off by default with a single domain")
                    + "; set router: true or name a domain"
                )
            return self
        if self.default_domain is not None and self.default_domain != "none" and self.default_domain not in self.domains:
            raise ValueError(
                f"default_domain {self.default_domain!r} is not a domain; choose one of "
                f"{sorted(self.domains) + ['none'] + (['auto'] if self.router_enabled else [])}"
            )
        return self

    @property
    def router_fallback(self) -> float:
        """The in-domain share the calibrated gate may send to "none" (used without router_threshold)."""
        return 0.05 if self.router_fallback_rate is None else self.router_fallback_rate

    @property
    def router_enabled(self) -> bool:
        """Whether a router is trained and exported (``router:``, by default with >= 2 domains)."""
        return self.router if self.router is not None else len(self.domains) >= 2

    @property
    def active_domain(self) -> str:
        """The domain active when the output directory is loaded."""
        return self.default_domain if self.default_domain is not None else next(iter(self.domains))


def parse_surgery_block(raw: Any, prefix: str = "surgery") -> SurgeryConfig:
    """Validate the ``surgery:`` mapping of a YAML file; raise SurgeryConfigError naming the field."""
    if not isinstance(raw, dict):
        raise SurgeryConfigError(f"{prefix}: expected a mapping, got {type(raw).__name__}")
    try:
        return SurgeryConfig.model_validate(raw)
    except ValidationError as error:
        raise SurgeryConfigError(format_validation_error(error, prefix)) from None
