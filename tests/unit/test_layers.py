"""The core's layers: config -> plan -> apply -> run, each importing only the layers below it, and no import circles;
the built-in plugins, the example plugin and the example scripts import only snnfw's public API (``snnfw.api``).

The layers and the public API are import-linter contracts in pyproject.toml; planted imports show that they bite.
"""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest


ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"snnfw": "snnfw", "snnfw_plugins": "plugins", "snnfw_spiking_mlp": "examples/spiking_mlp_plugin/snnfw_spiking_mlp"}


def packages(tree: Path, copy: bool = False) -> Path:
    """``tree`` holding the three packages the contracts cover (copies, or links to this checkout's) and
    pyproject.toml."""
    for name, folder in PACKAGES.items():
        if copy:
            shutil.copytree(ROOT / folder, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (tree / name).symlink_to(ROOT / folder, target_is_directory=True)
    shutil.copy(ROOT / "pyproject.toml", tree)
    return tree


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    """import-linter's contracts of ``tree/pyproject.toml`` over the packages found in ``tree``."""
    return subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())",
         "--config", str(tree / "pyproject.toml"), "--no-cache"],
        cwd=tree, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=120,
    )


def test_every_layer_imports_only_the_layers_below_it_and_plugins_only_the_public_api(tmp_path):
    result = lint_imports(packages(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


def test_a_reverse_import_breaks_the_layers(tmp_path):
    tree = packages(tmp_path, copy=True)
    errors = tree / "snnfw" / "errors.py"
    errors.write_text(errors.read_text() + "\nfrom snnfw.run import session  # planted: a base layer importing run\n")
    result = lint_imports(tree)
    assert result.returncode != 0
    assert "snnfw.errors -> snnfw.run.session" in result.stdout


@pytest.mark.parametrize("package, module", [("snnfw_plugins", "strategies/dp.py"), ("snnfw_spiking_mlp", "model.py")])
def test_a_plugin_importing_an_internal_module_breaks_the_public_api_contract(tmp_path, package, module):
    tree = packages(tmp_path, copy=True)
    planted = tree / package / module
    planted.write_text(planted.read_text() + "\nfrom snnfw.plan.layout import Proposal  # planted: an internal path\n")
    result = lint_imports(tree)
    assert result.returncode != 0
    importer = f"{package}.{module.removesuffix('.py').replace('/', '.')}"
    assert f"{importer} -> snnfw.plan.layout" in result.stdout, result.stdout


def internal_imports(source: str) -> list[str]:
    """The imports in ``source`` of snnfw's internals: any ``snnfw.X`` but ``snnfw.api``, and any name of ``snnfw``
    itself but its public ones."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = {alias.name for alias in node.names}
            if node.module == "snnfw" and names - {"Session", "__version__", "hookimpl", "start"}:
                found.append(f"from snnfw import {', '.join(sorted(names))}")
            elif node.module.startswith(("snnfw.", "snnfw_plugins")) and node.module != "snnfw.api":
                found.append(f"from {node.module} import {', '.join(sorted(names))}")
        elif isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names
                      if a.name.startswith(("snnfw.", "snnfw_plugins")) and a.name != "snnfw.api"]
    return found


def test_the_example_scripts_import_only_the_public_api():
    scripts = sorted(ROOT.glob("examples/*.py"))
    assert len(scripts) >= 3
    assert {s.name: internal_imports(s.read_text()) for s in scripts} == {s.name: [] for s in scripts}


def test_the_examples_check_finds_a_planted_internal_import():
    planted = "import snnfw\nfrom snnfw.api import start\n\ndef main():\n    from snnfw_plugins.datasets.synthetic_dvs import X\n"
    assert internal_imports(planted) == ["from snnfw_plugins.datasets.synthetic_dvs import X"]


def _circles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_module_imports_itself_through_others():
    graph = grimp.build_graph("snnfw", exclude_type_checking_imports=True)
    assert len(graph.modules) > 40
    assert _circles(graph) == []
