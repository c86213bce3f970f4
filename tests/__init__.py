"""The test suite; a package so that tests import shared code as ``tests.helpers``."""
