"""Write trained surgery modules into a mergekit output directory (docs/design.md §5).

The merged weight bytes are never rewritten: a single ``model.safetensors`` is only renamed into a
one-shard index, and the surgery tensors go to their own shard ``darts.safetensors``. Everything is
staged in a temporary folder inside ``out_dir`` and switched in with ``os.replace`` in an order that
keeps the directory a loadable plain merged model at every step; ``config.json`` claiming the Darts
architecture is written last, once weights, index and modeling files are in place.
File names and config keys come from ``layout``; the modules' shape from ``SurgeryShape``.
"""

import contextlib
import fcntl
import os
import shutil
import tempfile
from typing import Dict, Iterator, Optional

import torch
from safetensors.torch import save_file

from mergekit_darts import __version__
from mergekit_darts.output import card, layout
from mergekit_darts.output.info import read_darts_info  # noqa: F401 - its former home
from mergekit_darts.output.layout import (
    ARCH_PREFIX, DARTS_SHARD, INDEX, MODELING_FILES, NONE_DOMAIN, REPORT, RESERVED_DOMAINS, SINGLE_SHARD,
    SINGLE_WEIGHTS, STAGING_PREFIX, plain_architecture, plain_config, read_json, safetensors_header, write_json,
)
from mergekit_darts.remote_code.routing import DomainRouter
from mergekit_darts.remote_code.surgery import DomainSurgery, SurgeryShape

# the files shipped into every output directory (layout.MODELING_FILES) live in the remote_code package
PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "remote_code")


def shared_shape(modules: Dict[str, DomainSurgery], config: dict) -> SurgeryShape:
    """The one shape every module has (the emitted model builds all domains alike)."""
    if not modules:
        raise ValueError("modules: no surgery modules to export")
    shapes = {name: module.shape for name, module in modules.items()}
    first_name, shape = next(iter(shapes.items()))
    for name, module in modules.items():
        if shapes[name] != shape:
            raise ValueError(f"domain {name!r}: module shape {shapes[name]} differs from {first_name!r}'s {shape}")
        if module.hidden_size != config.get("hidden_size"):
            raise ValueError(
                f"domain {name!r}: module hidden_size={module.hidden_size}, but the model needs "
                f"{config.get('hidden_size')}"
            )
        if module.head_rank and module.vocab_size != config.get("vocab_size"):
            raise ValueError(
                f"domain {name!r}: head vocab {module.vocab_size} != model vocab {config.get('vocab_size')}"
            )
    return shape


def _check_domains(modules: Dict[str, DomainSurgery], experts: Dict[str, str], default_domain: str,
                   router: Optional[DomainRouter] = None, hidden_size=None) -> None:
    for reserved in RESERVED_DOMAINS:
        if reserved in modules:
            raise ValueError(f"domain name {reserved!r} is reserved")
    if set(modules) != set(experts):
        raise ValueError(f"experts {sorted(experts)} does not match the modules {sorted(modules)}")
    if router is not None:
        if sorted(router.domains) != sorted(modules):
            raise ValueError(f"router: routes to {router.domains}, but the modules are {sorted(modules)}")
        if router.hidden_size != hidden_size:
            raise ValueError(f"router: hidden_size={router.hidden_size}, but the model needs {hidden_size}")
    if default_domain == layout.AUTO_DOMAIN:
        if router is None:
            raise ValueError("default_domain: 'auto' needs a router; train one (router: true) or name a domain")
    elif default_domain != NONE_DOMAIN and default_domain not in modules:
        raise ValueError(f"default_domain: unknown domain {default_domain!r}; choose one of {[*modules, NONE_DOMAIN]}")


def darts_tensors(modules: Dict[str, DomainSurgery], router: Optional[DomainRouter] = None) -> Dict[str, torch.Tensor]:
    """``darts.<domain>.<param>`` (and ``darts.router.<param>``) -> float32 contiguous CPU tensor
    (the Darts model's state-dict keys)."""
    owners = {**modules, **({layout.ROUTER_NAME: router} if router is not None else {})}
    return {
        layout.darts_tensor_name(owner, key): value.detach().to("cpu", torch.float32).contiguous()
        for owner, module in owners.items()
        for key, value in module.state_dict().items()
    }


# ---------------------------------------------------------------------------------------------- export

@contextlib.contextmanager
def exclusive_export(out_dir: str) -> Iterator[None]:
    """One export at a time into ``out_dir`` (an advisory lock on the directory itself, released when the
    process ends however it ends): an export removes the staging folders it finds there as leftovers of a
    killed one, which would pull the files from under a second export still writing."""
    from mergekit_darts.errors import BusyError

    if not os.path.isdir(out_dir):  # the export's own checks name what is missing
        yield
        return
    handle = os.open(out_dir, os.O_RDONLY)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BusyError(f"{out_dir}: another mergekit-darts process is exporting into this directory; "
                            "run one export at a time per output directory") from None
        yield
    finally:
        os.close(handle)


def export_surgery(
    out_dir: str,
    modules: Dict[str, DomainSurgery],
    experts: Dict[str, str],
    default_domain: str,
    loss: str,
    report: Optional[dict] = None,
    extra_files: Optional[Dict[str, str]] = None,
    router: Optional[DomainRouter] = None,
) -> None:
    """Add the surgery ``modules`` (domain -> DomainSurgery) to the merged model in ``out_dir``.

    ``config.darts`` gets the modules' shape, ``loss`` and ``experts`` (domain -> expert model);
    ``default_domain`` (a domain or "none") becomes ``config.darts_domain``. ``report`` is written to
    darts_report.json and summarised in the model card; ``extra_files`` (name -> source path, or
    a function that writes the file at the path it is given) are copied or written in. ``router`` (optional) goes in as ``darts.router.*`` tensors and ``config.darts.router``
    settings; it makes ``default_domain="auto"`` possible. Running it again replaces the previous
    surgery entirely (a rerun without a router drops the earlier one).
    """
    with exclusive_export(out_dir):
        _export_surgery(out_dir, modules, experts, default_domain, loss, report, extra_files, router)


def _export_surgery(out_dir, modules, experts, default_domain, loss, report, extra_files, router) -> None:
    from mergekit_darts.repair.report.verdict import sanitized_report

    # NaN/inf in the report become null + a "non_finite_values" list: darts_report.json stays valid JSON
    report = sanitized_report(report) if report is not None else None
    config_path = os.path.join(out_dir, "config.json")
    config = read_json(config_path)
    arch = plain_architecture(config)
    shape = shared_shape(modules, config)
    _check_domains(modules, experts, default_domain, router, config.get("hidden_size"))
    darts_meta = layout.darts_entry(shape.to_meta(), loss, experts, __version__,
                                    extra={layout.ROUTER_NAME: router.to_meta()} if router is not None else None)
    for name, source in (extra_files or {}).items():
        if os.path.basename(name) != name or not (callable(source) or os.path.isfile(source)):
            raise ValueError(f"extra_files: {name!r} must be a plain file name with an existing source ({source!r})")

    merged_map = layout.merged_weight_map(out_dir)
    single = os.path.exists(os.path.join(out_dir, SINGLE_WEIGHTS))
    if single:
        merged_bytes = layout.tensor_bytes(safetensors_header(os.path.join(out_dir, SINGLE_WEIGHTS)))
        merged_params = layout.numel(safetensors_header(os.path.join(out_dir, SINGLE_WEIGHTS)))
        old_index = {"metadata": {}}
    else:
        headers = [safetensors_header(os.path.join(out_dir, f)) for f in sorted(set(merged_map.values()))]
        merged_bytes = sum(layout.tensor_bytes(h) for h in headers)
        merged_params = sum(layout.numel(h) for h in headers)
        old_index = read_json(os.path.join(out_dir, INDEX))
    tensors = darts_tensors(modules, router)
    added = sum(t.numel() for t in tensors.values())

    for leftover in os.listdir(out_dir):  # from an export that was killed before its cleanup
        if leftover.startswith(STAGING_PREFIX):
            shutil.rmtree(os.path.join(out_dir, leftover), ignore_errors=True)
    stage = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out_dir)
    try:
        staged = lambda name: os.path.join(stage, name)  # noqa: E731
        target = lambda name: os.path.join(out_dir, name)  # noqa: E731

        save_file(tensors, staged(DARTS_SHARD), metadata={"format": "pt"})
        metadata = {k: v for k, v in (old_index.get("metadata") or {}).items() if k != "total_size"}
        metadata["total_size"] = merged_bytes + sum(t.numel() * 4 for t in tensors.values())
        weight_map = {**merged_map, **{name: DARTS_SHARD for name in tensors}}
        write_json(staged(INDEX), {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))})
        write_json(staged("plain_index.json"), {"metadata": old_index.get("metadata") or {}, "weight_map": merged_map})
        write_json(staged("plain_config.json"), plain_config(config))
        for name in MODELING_FILES:
            shutil.copyfile(os.path.join(PACKAGE_DIR, name), staged(name))
        if report is not None:
            write_json(staged(REPORT), report)
        extras = []
        for name, source in (extra_files or {}).items():
            if callable(source):  # a writer (the bias plot): drawn into the stage, so a killed run leaves
                source(staged(name))  # it where the next export's cleanup finds it, not in $TMPDIR
            else:
                shutil.copyfile(source, staged(name))
            if os.path.exists(staged(name)):  # a best-effort writer may have written nothing
                extras.append(name)
        section = card.card_section(arch, darts_meta, default_domain, report, added, merged_params)
        with open(staged("README.md"), "w", encoding="utf-8") as handle:
            handle.write(card.updated_card(out_dir, section))
        darts_config = {**plain_config(config), "darts": darts_meta, "darts_domain": default_domain}
        darts_config["architectures"] = [ARCH_PREFIX + arch]
        darts_config["auto_map"] = {
            **(darts_config.get("auto_map") or {}),
            "AutoModelForCausalLM": f"modeling_darts.{ARCH_PREFIX}{arch}",
        }
        write_json(staged("config.json"), darts_config)

        # The switch. After every single os.replace the directory loads as a plain merged model.
        # 1. an earlier export: first back to a plain config and an index without darts entries
        if "darts" in config or config.get("architectures") != [arch]:
            os.replace(staged("plain_config.json"), config_path)
        if not single:
            os.replace(staged("plain_index.json"), target(INDEX))
        # 2. the darts shard, then the index naming it (ignored while model.safetensors exists)
        os.replace(staged(DARTS_SHARD), target(DARTS_SHARD))
        os.replace(staged(INDEX), target(INDEX))
        # 3. model.safetensors -> a shard of the index (a rename: the bytes stay as mergekit wrote them)
        if single:
            os.replace(target(SINGLE_WEIGHTS), target(SINGLE_SHARD))
        # 4. modeling code, report, extra files, card; a stale report of an earlier export goes
        for name in (*MODELING_FILES, *extras, "README.md"):
            os.replace(staged(name), target(name))
        if report is not None:
            os.replace(staged(REPORT), target(REPORT))
        elif os.path.exists(target(REPORT)):
            os.remove(target(REPORT))
        # 5. last: the config that claims the Darts architecture
        os.replace(staged("config.json"), config_path)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- info

