"""``python -m search +space=NAME``: see search/commands/cli.py."""

import sys

from search.commands.cli import main

if __name__ == "__main__":
    sys.exit(main())
