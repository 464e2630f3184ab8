"""Fixtures for the model tests live in tests/conftest.py (shared with the engine tests)."""
