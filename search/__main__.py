"""``python -m search +space=NAME``: see search/cli.py."""

import sys

from search.cli import main

if __name__ == "__main__":
    sys.exit(main())
