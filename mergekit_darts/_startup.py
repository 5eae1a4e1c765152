"""Start-up hook installed as ``mergekit_darts_hook.pth``: makes an unchanged ``mergekit-yaml`` run
the ``surgery:`` block.

mergekit has no plugin entry points, so this registers a meta-path finder that wraps
``mergekit.merge.run_merge`` right after that module executes (before ``mergekit-yaml`` binds the
name). It imports only the standard library: it runs in every Python process of the environment.
"""

import importlib.abc
import os
import sys

_TARGET = "mergekit.merge"


class _WrapLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        from mergekit_darts.hook import wrap_run_merge

        wrap_run_merge(module)


class _MergekitFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
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


def install() -> None:
    if os.environ.get("MERGEKIT_DARTS_DISABLE", "").strip().lower() in ("1", "true", "yes"):
        return
    if any(isinstance(f, _MergekitFinder) for f in sys.meta_path):
        return
    if _TARGET in sys.modules:
        from mergekit_darts.hook import wrap_run_merge

        wrap_run_merge(sys.modules[_TARGET])
        return
    sys.meta_path.insert(0, _MergekitFinder())
