"""The ATen ops and host synchronisations of one training step, snnfw's beside the plain loop's
(:mod:`snnfw.tools.launches`).

    python benchmark/launches.py examples/quickstart.toml --set parallel.strategy=none
"""

from snnfw.tools.launches import main

if __name__ == "__main__":
    raise SystemExit(main())
