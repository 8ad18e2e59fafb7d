"""Imported only by the fork server that starts trial workers (``isolation.worker_context``).

It ties the server's life to the study process that started it, then imports what every trial
needs, so a worker forked from the server starts with torch already imported. The server would
otherwise outlive a study killed with ``kill -9``: each worker it forks keeps the study's end of
the server's liveness pipe open, and a hung worker would keep both alive. With the server killed
with the study, every worker (killed with its parent, the server) goes too.
"""

from __future__ import annotations

from search.execution.isolation import die_with_parent

die_with_parent()
