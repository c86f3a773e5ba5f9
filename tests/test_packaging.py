"""pyproject.toml says what the package needs: the Python its imports need, the setuptools its
metadata needs."""
import ast
import tomllib
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# standard-library modules younger than Python 3.8, with the version that added them
STDLIB_SINCE = {"zoneinfo": (3, 9), "graphlib": (3, 9), "tomllib": (3, 11)}


def lowest_allowed(spec: str, versions) -> Version:
    """The lowest of ``versions`` that ``spec`` admits."""
    return min(v for v in map(Version, versions) if v in SpecifierSet(spec))


def imported_modules() -> dict[str, str]:
    """Top-level module → first file importing it unconditionally (not under a try/except that
    would catch its absence) in src/stableflash."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "src" / "stableflash").rglob("*.py")):
        tree = ast.parse(path.read_text())
        guarded = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) and t.handlers
                   for stmt in t.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in guarded:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return found


def test_requires_python_admits_no_python_without_a_module_the_package_imports():
    spec = PYPROJECT["project"]["requires-python"]
    imported = imported_modules()
    assert "tomllib" in imported                        # the scan sees the import that motivated the bound
    lowest = lowest_allowed(spec, [f"3.{minor}" for minor in range(8, 20)])
    for module, since in STDLIB_SINCE.items():
        if module in imported:
            assert lowest.release[:2] >= since, (
                f"requires-python {spec!r} admits Python {lowest}, but {imported[module]} imports {module}, "
                f"new in Python {since[0]}.{since[1]}")


def test_the_build_requirement_admits_no_setuptools_that_rejects_the_license_field():
    license_field = PYPROJECT["project"]["license"]
    assert isinstance(license_field, str)               # a PEP 639 expression, read from setuptools 77 on
    (setuptools,) = [r for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools")]
    spec = setuptools.removeprefix("setuptools")
    assert lowest_allowed(spec, ["64", "70.3.0", "76.1.0", "77.0.1", "80.9.0"]) >= Version("77")
