"""Judging measurements: the machine's noise floor and its drift, the Pareto front, racing, the
regime. Whether a measurement is stable against that floor is ``search.stability``."""
