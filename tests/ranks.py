"""Rank bodies for multi-rank tests (module level, so spawned ranks can import them)."""
