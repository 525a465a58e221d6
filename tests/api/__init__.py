"""Tests for the generated kai_fractions API and its protos."""
