"""The install story: pyproject and environment.yml agree, and the import layout is as documented."""

import importlib
import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ;]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert f"{project['name']}[lab]" in extras["dev"], "dev includes lab (the browser test needs JupyterLab)"
    wanted = {_name(r): r for r in project["dependencies"] + extras["lab"] + extras["dev"]
              if _name(r) != project["name"]}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    deps = env["dependencies"]
    assert any(str(d).startswith("python") for d in deps) and "pip" in deps
    pip_section = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    assert "-e .[dev]" in pip_section, "environment.yml installs the project itself through pip"
    listed = {_name(r): r for r in pip_section if not r.startswith("-e")}
    assert listed.keys() == wanted.keys(), (
        f"only in pyproject: {sorted(wanted.keys() - listed.keys())}, "
        f"only in environment.yml: {sorted(listed.keys() - wanted.keys())}"
    )
    for name, req in wanted.items():
        assert listed[name].replace(" ", "") == req.replace(" ", ""), f"{name}: {listed[name]!r} vs {req!r}"


def test_kernels_folder_imports_as_tutorial_kernels():
    mod = importlib.import_module("tutorial_kernels")
    assert Path(mod.__file__).resolve().parent == ROOT / "kernels"
    assert Path(importlib.import_module("tutorial_lib").__file__).resolve().parent == ROOT / "tutorial_lib"


def test_no_top_level_kernels_module_is_claimed():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = project["tool"]["setuptools"]["packages"]
    assert "kernels" not in packages, "`kernels` is a package on the index; we must not shadow it"
    assert {p.split(".")[0] for p in packages} == {"tutorial_lib", "tutorial_kernels"}


def test_every_subpackage_is_installed():
    """A sub-package missing from the list would be absent from a non-editable install."""
    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "tutorial_lib").rglob("__init__.py")}
    assert on_disk <= packages, f"not listed in pyproject [tool.setuptools] packages: {sorted(on_disk - packages)}"


def test_supported_torch_floor_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "torch>=2.8" in project["dependencies"]


def test_every_test_folder_is_collected(request):
    """pytest skips folders matching ``norecursedirs`` (by default also "dist"): none of ours may match."""
    import fnmatch

    patterns = request.config.getini("norecursedirs")
    folders = {p.parent for p in (ROOT / "tests").rglob("test_*.py")}
    skipped = [str(f.relative_to(ROOT)) for f in folders
               if any(fnmatch.fnmatch(part, pat) for part in f.relative_to(ROOT / "tests").parts for pat in patterns)]
    assert not skipped, f"test folders pytest would never collect: {skipped}"
