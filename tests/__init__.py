"""The test suite: one folder per package (``tests/platform/lab/bench/`` holds the tests of
``platform/lab/bench/``), ``e2e/`` for tests that start real processes, ``docs/`` for the docs.
A package so that tests import their shared helpers (``tests.support``) by name."""
