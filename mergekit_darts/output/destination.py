"""Where a run writes, checked before anything is merged (docs/reliability.md): the output folder can
be written and switched in atomically, and it is none of the run's inputs.

Symlinks are followed: ``out -> /disk/models/x`` writes ``/disk/models/x`` (staging beside the target,
the link left as it is). Torch-free.
"""

import os
import tempfile
from typing import Dict, Iterable, Optional, Tuple

from mergekit_darts.errors import SurgeryConfigError


def resolved(path: str) -> str:
    """The real location ``path`` names (symlinks followed, also a dangling one's target)."""
    return os.path.realpath(os.path.expanduser(path))


def check_output_writable(out_path: str, where: str = "output directory", switched_in: bool = True) -> None:
    """``out_path`` (if it exists) and the folder it is created in accept a new file: a real write probe,
    since ``os.access`` answers yes to root on a read-only mount point's permissions. ``switched_in``:
    the run replaces the folder as a whole (a merge), which a mount point cannot be."""
    path = resolved(out_path)
    shown = out_path if path == os.path.abspath(out_path) else f"{out_path} (-> {path})"
    if os.path.exists(path) and not os.path.isdir(path):
        raise SurgeryConfigError(f"{where} {shown!r}: exists and is not a directory; give a directory")
    if switched_in and os.path.ismount(path):
        raise SurgeryConfigError(
            f"{where} {shown!r}: is a mount point, which cannot be replaced atomically by the finished result; "
            f"give a folder inside it (e.g. {os.path.join(out_path, 'model')!r})")
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
                f"{where} {shown!r}: cannot write into {folder!r} ({error.strerror or error}); choose a "
                "writable output directory"
            ) from None


def _local(path: Optional[str], field: str) -> Optional[str]:
    """The real path of a local file or folder; None for a Hub id (or anything not on this machine).
    A cache folder is never a Hub id: it counts before it exists."""
    if not path:
        return None
    expanded = os.path.expanduser(str(path))
    return resolved(expanded) if os.path.exists(expanded) or field.endswith("cache_dir") else None


def check_not_an_input(out_path: str, inputs: Iterable[Tuple[str, Optional[str]]], where: str = "output directory",
                       replaced_whole: bool = True) -> None:
    """Refuse an output folder that is one of the run's inputs (``inputs``: (YAML field, path) pairs),
    compared after following symlinks and relative paths. ``replaced_whole`` (a merge): the folder's
    old contents are deleted at the switch, so an input *inside* it is refused too. There is no flag
    to force it: the merge reads its inputs while it writes, and a model replaced by its own merge
    cannot be re-run or checked; write elsewhere and move the result into place."""
    target = resolved(out_path)
    for field, path in inputs:
        real = _local(path, field)
        if real is None:
            continue
        inside = real.startswith(target.rstrip(os.sep) + os.sep)
        if real == target or (replaced_whole and inside):
            what = "is" if real == target else "holds"
            raise SurgeryConfigError(
                f"{where} {out_path!r} {what} {field} ({path!r}): writing the result there would "
                f"{'replace' if replaced_whole else 'modify'} an input of this run; choose another output "
                "directory (to replace the input deliberately, write elsewhere and move the result)")


def merge_inputs(merge_config) -> Dict[str, str]:
    """path -> field of every model a mergekit config reads: base_model, models/slices entries, LoRAs."""
    found: Dict[str, str] = {}
    base = getattr(merge_config, "base_model", None)
    for reference in merge_config.referenced_models():
        field = "base_model" if base is not None and reference == base else "a merge input (models/slices)"
        found.setdefault(str(reference.model.path), field)
        lora = getattr(reference, "lora", None)
        if lora is not None:
            found.setdefault(str(lora.path), f"{field}'s LoRA")
    return found


def surgery_inputs(surgery) -> Dict[str, str]:
    """path -> field of every file or model the surgery block reads, and of its cache folder."""
    found: Dict[str, str] = {}
    for name, domain in surgery.domains.items():
        found.setdefault(domain.model, f"surgery.domains.{name}.model")
        if domain.calibration.path:
            found.setdefault(domain.calibration.path, f"surgery.domains.{name}.calibration.path")
        if domain.calibration.synthesize_writer:
            found.setdefault(domain.calibration.synthesize_writer, f"surgery.domains.{name}.calibration.synthesize_writer")
    if surgery.router_eval is not None and surgery.router_eval.path:
        found.setdefault(surgery.router_eval.path, "surgery.router_eval.path")
    if surgery.cache_dir:
        found.setdefault(surgery.cache_dir, "surgery.cache_dir")
    return found
