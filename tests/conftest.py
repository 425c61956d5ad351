"""Test-suite wide settings. Multi-rank helpers live in ``tests/harness.py``."""
