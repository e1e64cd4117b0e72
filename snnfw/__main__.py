from snnfw import fast_exit
from snnfw.cli import main

fast_exit.run(main)
