"""Fixtures of the unit tests."""

from __future__ import annotations

from typing import Iterator

import pytest

from cpu_engine import native


@pytest.fixture
def restore_threads() -> Iterator[None]:
    """The threads our C kernels were told to use (native.set_threads, process-wide) are put back after the test."""
    before = native._threads
    yield
    native.set_threads(before)
