"""Judging measurements: the machine's noise floor, stability, the Pareto front, racing, the
regime."""
