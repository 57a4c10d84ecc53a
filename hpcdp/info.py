"""``python -m hpcdp.info`` (the ``hpcdp-info`` command): what hpcdp sees, as JSON.

This module is only a launcher. Imported, it puts the function :func:`hpcdp.info`
in its own place in ``sys.modules``, so ``import hpcdp.info`` leaves ``hpcdp.info``
the function instead of rebinding the name to a module.
"""
import sys

from hpcdp._runtime import info

if __name__ == "__main__":
    from hpcdp.cli.info import main
    sys.exit(main())
sys.modules[__name__] = info
