#!/usr/bin/env bash
# Checks snnfw as released: builds the wheel, installs it (not this tree) into a new virtual environment, and
# from outside the repository checks that snnfw and its plugins are imported from that wheel, that its entry
# points are pyproject.toml's, that `snnfw plugins` lists every built-in plugin loaded, and that the quickstart
# trains on 2 ranks (10 steps of it). CI runs it once (.ci/run).
#
#   bash scripts/wheel_check.sh
#
# The environment takes torch, SpikingJelly and snnfw's other dependencies from the Python that runs this script:
# that Python's site-packages folders are put on its path (a .pth file of folder names, as
# `python -m venv --system-site-packages` does, but without running their own .pth files, which would bring an
# editable snnfw's import hook along); snnfw itself comes only from the wheel.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
unset PYTHONPATH

# built from a copy of the tree's files (tracked, and untracked ones not ignored): no stale build/ folder of an
# earlier build can add files to the wheel, and the tree gains none
mkdir "$work/src"
git -C "$repo" ls-files -z --cached --others --exclude-standard | (cd "$repo" && tar --null -T - -cf -) | tar -xf - -C "$work/src"
python -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation -w "$work/dist" "$work/src"
wheel=("$work"/dist/snnfw-*.whl)
python -m venv --without-pip "$work/venv"
venv_python="$work/venv/bin/python"
site=$("$venv_python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
python -c "import sys; print(*[p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))], sep='\n')" \
  > "$site/snnfw_wheel_check_dependencies.pth"
"$venv_python" -m pip install --quiet --disable-pip-version-check --no-deps --ignore-installed "${wheel[0]}"
echo "wheel_check: installed $(basename "${wheel[0]}") into $work/venv"

cd "$work"  # outside the repository: nothing of the tree is importable
"$venv_python" - "$work/src" "$site" <<'EOF'
import importlib.metadata
import sys
import tomllib
from pathlib import Path

import snnfw
import snnfw_plugins

src, site = Path(sys.argv[1]), Path(sys.argv[2])
for module in (snnfw, snnfw_plugins):
    assert Path(module.__file__).is_relative_to(site), f"{module.__name__} imported from {module.__file__}, not {site}"
dist = importlib.metadata.distribution("snnfw")
assert Path(dist.locate_file("")).resolve() == site.resolve(), f"snnfw's metadata comes from {dist.locate_file('')}"
modules = {f"snnfw/{p.relative_to(src / 'snnfw').as_posix()}" for p in (src / "snnfw").rglob("*.py")}
modules |= {f"snnfw_plugins/{p.relative_to(src / 'plugins').as_posix()}" for p in (src / "plugins").rglob("*.py")}
missing = sorted(modules - {f.as_posix() for f in dist.files})
assert not missing, f"the wheel lacks {missing}: add their packages to pyproject.toml's [tool.setuptools] packages"
declared = tomllib.loads((src / "pyproject.toml").read_text())["project"]["entry-points"]
for group, entries in declared.items():
    shipped = {ep.name: ep.value for ep in dist.entry_points.select(group=group)}
    assert shipped == entries, f"the wheel's [{group}] entry points differ from pyproject.toml's: {shipped} != {entries}"
print(f"wheel_check: snnfw {snnfw.__version__} from {Path(snnfw.__file__).parent}, "
      f"its {len(modules)} modules, {sum(map(len, declared.values()))} entry points as declared")
EOF

"$work/venv/bin/snnfw" plugins --json > plugins.json
"$venv_python" - "$repo/pyproject.toml" plugins.json <<'EOF'
import json
import sys
import tomllib
from pathlib import Path

builtin = tomllib.loads(Path(sys.argv[1]).read_text())["project"]["entry-points"]["snnfw"]
rows = {row["name"]: row for row in json.loads(Path(sys.argv[2]).read_text())}
missing = sorted(set(builtin) - set(rows))
assert not missing, f"snnfw plugins does not list {missing}"
failed = {name: rows[name]["error"] for name in builtin if rows[name]["error"] or rows[name]["distribution"] != "snnfw"}
assert not failed, f"built-in plugins not loaded from the wheel: {failed}"
registered = {}
for row in rows.values():
    for kind, names in row["registers"].items():
        registered.setdefault(kind, []).extend(names)
for kind in ("strategy", "model family", "dataset", "schedule"):
    assert registered.get(kind), f"no {kind} registered: {sorted(registered)}"
print("wheel_check: snnfw plugins lists " + "; ".join(f"{kind}: {', '.join(sorted(names))}"
                                                      for kind, names in sorted(registered.items())))
EOF

"$work/venv/bin/snnfw" train "$repo/examples/quickstart.toml" --nproc 2 --set train.steps=10 --run-dir "$work/run"
"$venv_python" - "$work/run/summary.json" <<'EOF'
import json
import math
import sys

summary = json.load(open(sys.argv[1]))
assert math.isfinite(summary["final_loss"]), summary["final_loss"]
print(f"wheel_check: the quickstart trained from the wheel, final loss {summary['final_loss']:.4f}")
EOF
