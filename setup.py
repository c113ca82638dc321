"""Map the four top-level code folders onto the ``retouch`` distribution.

The folders have no ``__init__.py`` (``platform/`` would shadow the standard library), so
``retouch`` and ``retouch.<folder>`` are PEP 420 namespace packages that setuptools cannot
discover by itself. Every subpackage is listed explicitly because regular (non-editable)
wheels silently drop any package that is not listed.
"""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
CODE_FOLDERS = ("functions", "runtime", "cachestore", "platform")
SKIP = {"__pycache__"}


def _subpackages(folder: str) -> dict[str, str]:
    """``retouch.<folder>`` and every directory of Python code below it."""
    if not (ROOT / folder).is_dir():
        return {}
    mapping = {f"retouch.{folder}": folder}
    for path in sorted((ROOT / folder).rglob("*")):
        rel = path.relative_to(ROOT)
        if path.is_dir() and not SKIP.intersection(rel.parts) and any(path.glob("*.py")):
            mapping["retouch." + ".".join(rel.parts)] = rel.as_posix()
    return mapping


package_dir: dict[str, str] = {}
for _folder in CODE_FOLDERS:
    package_dir.update(_subpackages(_folder))

# Trained demo weights ship inside the package (diffusers folders: json, txt, safetensors).
WEIGHTS = [
    "weights/*/*.json",
    "weights/*/*/*.json",
    "weights/*/*/*.txt",
    "weights/*/*/*.safetensors",
]
package_data = {name: ["*.json", "*.txt", "*.toml", "*.png"] for name in package_dir}
if "retouch.functions.demo" in package_data:
    package_data["retouch.functions.demo"] += WEIGHTS
# The web page (plain HTML, CSS and JavaScript; no build step).
if "retouch.platform.api.web" in package_data:
    package_data["retouch.platform.api.web"] += ["static/*.html", "static/*.js", "static/*.css"]

setup(
    packages=list(package_dir),
    package_dir=package_dir,
    package_data=package_data,
)
