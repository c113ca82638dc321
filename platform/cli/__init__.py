"""The ``retouch`` command groups, one module each; :mod:`retouch.platform.cli.main` assembles them.

Each module has ``register(sub)``, which adds its subcommands (arguments, help texts and
the function run for them) to the top-level subparsers. Modules import nothing heavy at
import time: the CLI loads without torch (``tests/test_import_contract.py``).
"""
