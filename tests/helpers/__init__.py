"""Shared helpers of the tests, one module a subject; tests/conftest.py holds the pytest fixtures that use them."""
