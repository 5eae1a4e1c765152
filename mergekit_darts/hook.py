"""The mergekit post-merge hook: ``run_merge`` that also honours a ``surgery:`` block.

``_startup`` (installed as a .pth file) calls ``wrap_run_merge`` when ``mergekit.merge`` is first
imported, so ``mergekit-yaml`` — which does ``from mergekit.merge import run_merge`` — gets the
wrapped function. Without a surgery block, or with MERGEKIT_DARTS_DISABLE=1, it is plain mergekit.
"""

import functools
import logging
import os
import sys

LOG = logging.getLogger(__name__)
_ORIGINAL_ATTR = "__mergekit_darts_original__"


def disabled() -> bool:
    return os.environ.get("MERGEKIT_DARTS_DISABLE", "").strip().lower() in ("1", "true", "yes")


def original_run_merge():
    import mergekit.merge

    current = mergekit.merge.run_merge
    return getattr(current, _ORIGINAL_ATTR, current)


def wrap_run_merge(module) -> None:
    original = getattr(module, "run_merge", None)
    if original is None or hasattr(original, _ORIGINAL_ATTR):
        return

    @functools.wraps(original)
    def run_merge(merge_config, out_path, options=None, config_source=None, *args, **kwargs):
        if disabled() or not config_source or "surgery" not in config_source:
            return original(merge_config, out_path, options, config_source, *args, **kwargs)
        return run_merge_with_surgery(original, merge_config, out_path, options, config_source, *args, **kwargs)

    setattr(run_merge, _ORIGINAL_ATTR, original)
    module.run_merge = run_merge


def run_merge_with_surgery(original, merge_config, out_path, options, config_source, *args, **kwargs):
    """Validate the surgery block before merging (a typo costs seconds, not a 70B merge), merge,
    then repair ``out_path``. Returns the surgery report, or None for a plain merge."""
    from mergekit.options import MergeOptions

    from .pipeline import effective_seed, parse_config_source, repair_directory
    from .preflight import check_before_merge

    options = options or MergeOptions()
    _, surgery = parse_config_source(config_source)
    if surgery is None:
        original(merge_config, out_path, options, config_source, *args, **kwargs)
        return None
    texts = check_before_merge(surgery, merge_config, seed=effective_seed(surgery, options),
                       trust_remote_code=bool(options.trust_remote_code))
    original(merge_config, out_path, options, config_source, *args, **kwargs)
    if not options.quiet:
        print(f"mergekit-darts: merge written to {out_path}; running {surgery.method} surgery "
              f"on {len(surgery.domains)} domain(s)", file=sys.stderr)
    try:
        report = repair_directory(out_path, surgery, options=options, texts=texts)
    except Exception:
        LOG.error(
            "Surgery failed; %s is left as the plain merged model. Fix the cause and run "
            "`mergekit-darts surgery CONFIG %s` to repair it without merging again.", out_path, out_path,
        )
        raise
    if not options.quiet:
        for name, entry in report["domains"].items():
            bias, kl = entry["bias"], entry.get("held_out_kl") or {}
            line = f"mergekit-darts: {name}: held-out bias {bias['mean_before']:.4f} -> {bias['mean_after']:.4f}"
            if kl.get("before") is not None:
                line += f", KL to expert {kl['before']:.4f} -> {kl['after']:.4f}"
            print(line, file=sys.stderr)
    return report
