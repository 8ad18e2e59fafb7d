"""Nightly re-tuning: re-measure the last recommendation, search a little, give a verdict."""
