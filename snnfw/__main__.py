import sys

from snnfw.cli import main

sys.exit(main())
