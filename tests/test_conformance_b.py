"""The conformance suite, the second half of the architectures (tests/conformance.py)."""

from .conformance import conformance_test

test_architecture = conformance_test(1, 2)
