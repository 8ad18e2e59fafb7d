"""Search spaces: a space file's parameters, constraints and objectives as typed values."""
