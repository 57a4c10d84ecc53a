"""``python -m hpcdp.info``: print hpcdp.info() as JSON (see hpcdp.cli.info)."""
import sys

from hpcdp.cli.info import main

if __name__ == "__main__":
    sys.exit(main())
