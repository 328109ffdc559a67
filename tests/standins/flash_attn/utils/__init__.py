"""Stand-in (see flash_attn/__init__.py)."""
