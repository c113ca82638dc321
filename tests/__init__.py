"""The test suite: one folder per package (``tests/platform/bench/`` holds the tests of
``platform/bench/``), ``e2e/`` for tests that start real processes, ``docs/`` for the docs.
A package so that tests import their shared helpers (``tests.support``) by name."""
