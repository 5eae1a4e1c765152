"""mergekit-darts: repair merged decoder LLMs with DARTS representation surgery.

Importing this package is cheap on purpose: the mergekit start-up hook imports it in every Python
process, so heavy modules (torch, transformers, mergekit) are imported by the submodules only.
"""

__version__ = "0.1.0"
