"""The command that installs an optional extra (``[eval]``, ``[data]``, ``[sweep]``), for how this
copy of mergekit-darts was installed.

``pip install 'mergekit-darts[eval]'`` only works for a package that came from an index: from a
clone it fails ("No matching distribution") or replaces the clone with a release. pip records how a
package was installed (PEP 610 ``direct_url.json``); this reads it and prints the command that
adds the extra to *this* installation: the editable clone with its constraints, the same wheel file,
or the index name. Torch-free and cheap: error messages call it.
"""

import json
import os
import shlex
from typing import Optional

DISTRIBUTION = "mergekit-darts"
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _installation():
    """(installed by pip?, its ``direct_url.json`` or None). No direct URL: it came from an index."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        text = distribution(DISTRIBUTION).read_text("direct_url.json")
    except PackageNotFoundError:  # not installed: e.g. a checkout on PYTHONPATH
        return False, None
    try:
        return True, (json.loads(text) if text else None)
    except ValueError:
        return True, None


def _local_path(url: str) -> Optional[str]:
    if not url.startswith("file://"):
        return None
    from urllib.parse import unquote, urlparse

    return unquote(urlparse(url).path)


def _checkout_root() -> Optional[str]:
    """The clone this package is imported from (its pyproject.toml names mergekit-darts), or None."""
    root = os.path.dirname(_PACKAGE_DIR)
    try:
        with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as handle:
            return root if f'name = "{DISTRIBUTION}"' in handle.read() else None
    except OSError:
        return None


def _from_clone(root: str, extra: str, cwd: str, editable: bool) -> str:
    constraints = os.path.join(root, "constraints.txt")
    if os.path.abspath(cwd) == os.path.abspath(root):
        target, constraints_arg = f'".[{extra}]"', "constraints.txt"
    else:
        target, constraints_arg = shlex.quote(f"{root}[{extra}]"), shlex.quote(constraints)
    pin = f"-c {constraints_arg} " if os.path.exists(constraints) else ""
    return f"pip install {pin}{'-e ' if editable else ''}{target}"


def install_command(extra: str, cwd: Optional[str] = None) -> str:
    """``pip install ...`` that adds ``extra`` to the installed mergekit-darts."""
    cwd = cwd or os.getcwd()
    installed, direct = _installation()
    if direct is not None:
        path = _local_path(direct.get("url", ""))
        if path and "dir_info" in direct and os.path.isdir(path):  # a clone, editable or not
            editable = bool(direct["dir_info"].get("editable"))
            return _from_clone(path, extra, cwd, editable)
        if path and os.path.isfile(path):  # a wheel or sdist file
            return f"pip install {shlex.quote(f'{path}[{extra}]')}"
        if "vcs_info" in direct:  # pip install git+https://...
            spec = f"{DISTRIBUTION}[{extra}] @ {direct['vcs_info'].get('vcs', 'git')}+{direct.get('url')}"
            return f"pip install {shlex.quote(spec)}"
    elif not installed and _checkout_root() is not None:
        return _from_clone(_checkout_root(), extra, cwd, editable=True)
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def needs(what: str, extra: str) -> str:
    """``"<what> needs the [extra] extra: pip install ..."`` for an error message."""
    return f"{what} needs the [{extra}] extra: {install_command(extra)}"
