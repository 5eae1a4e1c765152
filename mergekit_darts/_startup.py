"""Start-up hook installed as ``mergekit_darts_hook.pth``: makes an unchanged ``mergekit-yaml`` run
the ``surgery:`` block.

mergekit has no plugin entry points, so this registers a meta-path finder that wraps
``mergekit.merge.run_merge`` right after that module executes (before ``mergekit-yaml`` binds the
name). It runs in every Python process of the environment, so it is kept to the bare minimum:
no imports at all at module level (``sys`` is already loaded by the time ``site`` runs .pth
files; ``importlib.abc`` alone used to cost ~45 ms: the finder and loader are duck-typed instead),
and the ``.pth`` line checks MERGEKIT_DARTS_DISABLE before importing this module. Nothing here may
raise: a broken mergekit-darts must leave plain mergekit working (one warning line, then mergekit
runs unwrapped).
"""

import sys

_TARGET = "mergekit.merge"
_PACKAGE = "mergekit"  # its first import: before mergekit imports peft -> bitsandbytes (import-time noise)
_DISABLE_VALUES = ("1", "true", "yes")
_warned = []


def _warn_once(what: str, error: BaseException) -> None:
    """One line on stderr, once per process: a broken plugin must not bury mergekit's own output."""
    if _warned:
        return
    _warned.append(True)
    try:
        import logging

        logging.getLogger("mergekit_darts").warning(
            "mergekit-darts: %s failed (%s: %s); mergekit runs without surgery support",
            what, type(error).__name__, str(error).splitlines()[0] if str(error) else "")
    except Exception:  # noqa: BLE001 - logging itself broken: stay silent rather than break the import
        pass


def _quiet() -> None:
    """Filter known third-party noise (console.THIRD_PARTY_NOISE) in processes that use mergekit."""
    try:
        from mergekit_darts.console import filter_third_party_noise

        filter_third_party_noise()
    except Exception as error:  # noqa: BLE001 - noise filtering is a nicety: never break the import
        _warn_once("filtering third-party warnings", error)


def _wrap(module) -> None:
    try:
        from mergekit_darts.hook import wrap_run_merge

        wrap_run_merge(module)
    except Exception as error:  # noqa: BLE001 - any import/wrapping error leaves mergekit plain
        _warn_once("wrapping mergekit.merge.run_merge", error)


class _WrapLoader:
    """Delegates to mergekit's real loader and wraps ``run_merge`` once the module has executed."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        self._loader.exec_module(module)
        _wrap(module)

    def __getattr__(self, name):  # get_source, get_filename, is_package, ...: the real loader's
        return getattr(self._loader, name)


class _MergekitFinder:
    """A meta-path finder (duck-typed: ``sys.meta_path`` only needs ``find_spec``)."""

    def find_spec(self, fullname, path, target=None):
        if fullname == _PACKAGE:
            _quiet()
            return None
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _WrapLoader(spec.loader)
                return spec
        return None

    def invalidate_caches(self):
        pass


def disabled(environ=None) -> bool:
    import os

    value = (environ if environ is not None else os.environ).get("MERGEKIT_DARTS_DISABLE", "")
    return value.strip().lower() in _DISABLE_VALUES


def install() -> None:
    """Register the finder (or wrap an already imported mergekit.merge). Never raises."""
    try:
        if disabled():
            return
        if any(isinstance(f, _MergekitFinder) for f in sys.meta_path):
            return
        if _TARGET in sys.modules:
            _wrap(sys.modules[_TARGET])
            return
        sys.meta_path.insert(0, _MergekitFinder())
    except Exception as error:  # noqa: BLE001
        _warn_once("installing the start-up hook", error)
