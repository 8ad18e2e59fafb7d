"""What a study concludes and what a person reads: results, lines, tables, files, the oracle
view."""
