"""The core's layers: config -> plan -> apply -> run, each importing only the layers below it, and no import circles.

The layers are the import-linter contract in pyproject.toml; a planted reverse import shows the contract bites.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter's contracts of ``root/pyproject.toml`` over the ``snnfw`` package found in ``root``."""
    return subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())",
         "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=120,
    )


def test_every_layer_imports_only_the_layers_below_it():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_a_reverse_import_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "snnfw", tmp_path / "snnfw")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    errors = tmp_path / "snnfw" / "errors.py"
    errors.write_text(errors.read_text() + "\nfrom snnfw.run import session  # planted: a base layer importing run\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "snnfw.errors -> snnfw.run.session" in result.stdout


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
