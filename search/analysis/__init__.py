"""Judging measurements: the machine's noise floor and its drift, stability, the Pareto front,
racing, the regime."""
