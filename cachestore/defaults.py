"""Defaults of the store's knobs, readable without importing the store (lmdb, torch):
the executor's options and ``retouch serve`` take them from here."""

HOST_BUDGET_BYTES = 4 << 30  # host-RAM tier of one store (one executor)
