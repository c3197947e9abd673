"""The proof harness: ``celery-ledger demo`` and ``celery-ledger verify``.

Real ``celery worker`` and ``celery beat`` processes in a sandbox, a synthetic workload, a
bounded chaos loop, and the tally of lost and duplicated effects, for the ledgered run and for
plain Celery side by side. Nothing in the runtime (``celery_ledger``) imports this package.

- ``processes``: starting, watching and stopping Celery processes (shared with the tests and
  the benchmarks);
- ``orchestrate``: the sandbox, the workload and the side-by-side report;
- ``demo`` / ``verify`` and their app ``demo_app``; ``examples``: the README's example app;
- ``tcpproxy``: a TCP proxy that cuts the ledger's connections on demand.
"""
