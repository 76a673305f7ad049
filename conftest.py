"""Fixtures shared by the test files (pytest reads this file first)."""
import pytest


@pytest.fixture
def torch_path(monkeypatch):
    """Models on the PyTorch fallback: test_all.py tests the Triton interpreter on the forms, and it is slow."""
    import kernel  # here, not at the top: test_all.py must set TRITON_INTERPRET before triton is imported
    monkeypatch.setattr(kernel, "INTERPRET", False)
