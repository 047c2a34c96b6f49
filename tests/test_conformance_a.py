"""The conformance suite, the first half of the architectures (tests/conformance.py; the
architectures are split over two files so that the suite's two workers share them)."""

from .conformance import conformance_test

test_architecture = conformance_test(0, 2)
