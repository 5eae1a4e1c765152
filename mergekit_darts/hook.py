"""The mergekit post-merge hook: ``run_merge`` that also honours a ``surgery:`` block.

``_startup`` (installed as a .pth file) calls ``wrap_run_merge`` when ``mergekit.merge`` is first
imported, so ``mergekit-yaml`` — which does ``from mergekit.merge import run_merge`` — gets the
wrapped function. Without a surgery block, or with MERGEKIT_DARTS_DISABLE=1, it is plain mergekit.
All the work is ``pipeline.merge_and_repair``, which gets mergekit's original function passed in.
"""

import functools
import os

_ORIGINAL_ATTR = "__mergekit_darts_original__"


def disabled() -> bool:
    return os.environ.get("MERGEKIT_DARTS_DISABLE", "").strip().lower() in ("1", "true", "yes")


def original_run_merge():
    """mergekit's own ``run_merge``, whether or not it has been wrapped."""
    import mergekit.merge

    current = mergekit.merge.run_merge
    return getattr(current, _ORIGINAL_ATTR, current)


def wrap_run_merge(module) -> None:
    original = getattr(module, "run_merge", None)
    if original is None or hasattr(original, _ORIGINAL_ATTR):
        return

    @functools.wraps(original)
    def run_merge(merge_config, out_path, options=None, config_source=None, *args, **kwargs):
        from mergekit_darts.yaml_source import mentions_surgery

        # a near miss (`surgey:`) goes in too: it must fail, not merge plainly (docs/reliability.md)
        if disabled() or not config_source or not mentions_surgery(config_source):
            return original(merge_config, out_path, options, config_source, *args, **kwargs)
        from mergekit_darts.console import user_logging
        from mergekit_darts.errors import DartsError, to_click_error

        try:
            from mergekit_darts.pipeline import merge_and_repair
        except ImportError as error:  # a broken install: say so in one line instead of a traceback
            raise to_click_error(DartsError(
                f"surgery: mergekit-darts cannot run the surgery: block ({type(error).__name__}: {error}); "
                "reinstall mergekit-darts, or set MERGEKIT_DARTS_DISABLE=1 and remove the block")) from None

        def merge(config, path, opts, source):
            return original(config, path, opts, source, *args, **kwargs)

        try:
            with user_logging():
                merge_and_repair(config_source, out_path, merge, options=options, merge_config=merge_config)
        except DartsError as error:
            raise to_click_error(error) from None
        except KeyboardInterrupt as error:  # Ctrl-C or SIGTERM: one line saying where the output is, 130 / 143
            from mergekit_darts.interrupts import exit_interrupted

            exit_interrupted(error)

    setattr(run_merge, _ORIGINAL_ATTR, original)
    module.run_merge = run_merge
    _wrap_config_validation()
    _wrap_yaml_reading()


class _OneLineYaml:
    """``yaml`` as ``mergekit-yaml``'s module sees it: ``safe_load`` reports a syntax error as one
    ``Error: config: not valid YAML: ...`` line (as ``mergekit-darts run`` does) instead of a traceback."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def safe_load(self, stream):
        try:
            return self._real.safe_load(stream)
        except self._real.YAMLError as error:
            if disabled():
                raise
            from mergekit_darts.errors import MergeConfigError, to_click_error, yaml_error_line

            raise to_click_error(MergeConfigError(yaml_error_line(error))) from None


def _wrap_yaml_reading() -> None:
    """``mergekit-yaml`` parses the file before anything of ours runs; its module (being imported when
    ``mergekit.merge`` is, since it imports ``run_merge``) gets the one-line ``yaml``. Nothing else does."""
    import sys

    module = sys.modules.get("mergekit.scripts.run_yaml")
    real = getattr(module, "yaml", None)
    if real is not None and not isinstance(real, _OneLineYaml) and hasattr(real, "YAMLError"):
        module.yaml = _OneLineYaml(real)


def _wrap_config_validation() -> None:
    """``mergekit-yaml`` validates ``MergeConfiguration`` before it calls ``run_merge``: for a config with
    a ``surgery:`` block, its failure (a pydantic error, or the RuntimeError of "no models") becomes
    one ``Error:`` line too. Plain configs keep mergekit's own behaviour."""
    import mergekit.config

    config_class = mergekit.config.MergeConfiguration
    original = config_class.model_validate
    if hasattr(original, _ORIGINAL_ATTR):
        return

    def model_validate(cls, obj, *args, **kwargs):
        if cls is config_class and not disabled() and not isinstance(obj, (dict, config_class)):
            # a top-level list, scalar or empty file is no mergekit config, plain or not: one line
            # instead of pydantic's traceback (a YAML syntax error fails before this, in mergekit-yaml)
            from mergekit_darts.errors import MergeConfigError, to_click_error

            raise to_click_error(MergeConfigError(
                f"config: the file holds {_kind(obj)}, not a mapping of mergekit keys (merge_method, models, ...)"))
        if cls is not config_class or disabled() or not (isinstance(obj, dict) and "surgery" in obj):
            return original.__func__(cls, obj, *args, **kwargs)
        from mergekit_darts.errors import to_click_error
        from mergekit_darts.preflight import merge_config_error

        try:
            return original.__func__(cls, obj, *args, **kwargs)
        except Exception as error:  # noqa: BLE001 - pydantic, RuntimeError, ValueError: all one line
            raise to_click_error(merge_config_error(error)) from None

    setattr(model_validate, _ORIGINAL_ATTR, original)
    config_class.model_validate = classmethod(model_validate)


def _kind(value) -> str:
    """What a YAML document's top level is, in words."""
    if value is None:
        return "nothing (an empty document)"
    if isinstance(value, list):
        return f"a list of {len(value)} item(s)"
    return f"a {type(value).__name__} ({str(value)[:40]!r})"
