"""Tests by method: each method through every adapter against one shared reference."""
