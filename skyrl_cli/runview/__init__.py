"""Looking at runs from their run directories alone (no account, no network): ``skyrl runs``.

- ``catalog``: find run directories under a folder, resolve a ``RUN`` argument, a run's status and
  final figures (``summary.json`` when the run has ended, else its events so far);
- ``curves``: metric curves from ``events.jsonl`` against step and wall time, and the report's panels;
- ``report``: the figures (matplotlib, Agg, imported lazily) and the self-contained HTML page.

Light: the standard library and ``skyrl_cli``'s contract modules; matplotlib only inside ``report``'s
functions, so ``skyrl --help`` never loads it.
"""
