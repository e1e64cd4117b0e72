"""The pages a newcomer sees the system in keep up with the code: docs/architecture.md names every module of the
core (each file under snnfw/ on a line of its own in the doc's tree, under its folder; a package's ``__init__.py``
the folder's line; no file that is gone), and docs/strategies.md opens with the dimensions, each with the plugin
that owns it, and then the presets."""

import re
from pathlib import Path

from snnfw.plan.compose import owners
from snnfw.plan.presets import PRESETS
from snnfw.plugin.manager import Plugins

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def listed(text: str) -> dict[str, str]:
    """The files and folders of snnfw/ that the doc's tree names (folders ending in /), with what each line says."""
    tree = text.split("```\nsnnfw/\n", 1)[1].split("```", 1)[0]
    found: dict[str, str] = {}
    folders: list[str] = []
    for line in tree.splitlines():
        if not line.startswith(" "):  # the next top-level entry (plugins/, ...): snnfw/ ends
            break
        indent = len(line) - len(line.lstrip())
        name, _, said = line.strip().partition(" ")
        if indent > 2 * (len(folders) + 1) or not name.endswith((".py", "/")):
            continue  # a line that goes on with the description above it
        folders = folders[:indent // 2 - 1]
        found["/".join([*folders, name])] = said.strip()
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
    return found


def modules() -> set[str]:
    """Every file of snnfw/ the tree must name: a package's ``__init__.py`` as its folder."""
    paths = {str(path.relative_to(ROOT / "snnfw")) for path in (ROOT / "snnfw").rglob("*.py")}
    return {path.removesuffix("__init__.py") if path.count("/") and path.endswith("/__init__.py") else path
            for path in paths}


def test_the_architecture_names_every_module_of_the_core_on_a_line_of_its_own():
    tree = listed(DOC.read_text())
    missing, gone = sorted(modules() - set(tree)), sorted(set(tree) - modules())
    assert not missing and not gone, f"docs/architecture.md misses {missing} and names files that are gone: {gone}"
    assert all(tree.values()), f"lines that say nothing: {[name for name, said in tree.items() if not said]}"


def test_the_check_reads_the_tree_by_folder():
    """A file named under the wrong folder, or only in a description, does not count."""
    planted = ("```\nsnnfw/\n  plan/             planning\n    layout.py       the plan\n"
               "                    layout.py in words, not a line\n  tools/            tools\n"
               "    probe.py        the probe\n  api.py            the API\nplugins/          not the core\n"
               "  defaults.py     no\n```\n")
    assert listed(planted) == {"plan/": "planning", "plan/layout.py": "the plan", "tools/": "tools",
                               "tools/probe.py": "the probe", "api.py": "the API"}


def tables(text: str) -> list[list[list[str]]]:
    """The markdown tables of ``text`` in order, each a list of rows of cells (header and rule left out)."""
    found, rows = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif rows:
            found.append(rows[2:])
            rows = []
    return found


def test_strategies_md_opens_with_the_dimensions_and_their_owners_then_the_presets():
    text = (ROOT / "docs" / "strategies.md").read_text()
    assert text.split("\n## ", 1)[0].count("\n| --- ") == 2, "the page's opening holds the two tables"
    dimensions, presets = tables(text)[:2]
    assert {row[0].strip("`"): row[1].strip("`") for row in dimensions} == owners(Plugins())
    assert all(len(row) == 6 and all(row) for row in dimensions), "every dimension says all five things"
    names = [row[0].strip("`") for row in presets]
    assert set(PRESETS) | {"none", "mesh", "auto"} == set(names)
    for name, preset in PRESETS.items():
        spelled = presets[names.index(name)][1]
        assert all(re.search(rf"\b{dim} = ", spelled) for dim in preset.dims), f"{name}'s mesh: {spelled}"
