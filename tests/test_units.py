"""Sizes as people read them, and two sizes compared: never one figure on both sides."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tessel.units import human_bytes, two_sizes

MIB = 1 << 20


def test_sizes_far_apart_read_as_human_bytes_do():
    assert two_sizes(3.1 * MIB, 3 * MIB) == ("3.10 MiB", "3.00 MiB")
    assert two_sizes(2 * MIB, 3 << 30) == ("2.00 MiB", "3.00 GiB")
    assert two_sizes(5, 7) == ("5 B", "7 B")


def test_close_sizes_take_a_digit_more_then_exact_bytes():
    assert human_bytes(3 * MIB + 2000) == human_bytes(3 * MIB)  # what the messages said
    assert two_sizes(3 * MIB + 2000, 3 * MIB) == ("3.002 MiB", "3.000 MiB")
    assert two_sizes(3 * MIB + 100, 3 * MIB) == ("3,145,828 bytes", "3,145,728 bytes")


def test_equal_sizes_read_equal():
    assert two_sizes(3 * MIB, 3 * MIB) == ("3.00 MiB", "3.00 MiB")


@given(st.integers(0, 1 << 45), st.integers(0, 1 << 45))
@settings(derandomize=True, max_examples=300, deadline=None)
def test_different_sizes_never_read_alike(a, b):
    x, y = two_sizes(a, b)
    assert (x == y) == (a == b)
