"""The commands: tune (the default), sync, retune and history, behind one command line."""
