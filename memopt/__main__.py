"""``python -m memopt``: see ``memopt/cli.py``."""
import sys

from memopt.cli import main

if __name__ == "__main__":
    sys.exit(main())
