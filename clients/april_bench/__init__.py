"""april-bench: the RL load tester comparing sync rollouts with APRIL partial rollouts.

Modules: `workload` (seeded prompt/budget streams), `driver` (one mode's RL loop), `session`
(all modes against one server), `accounting` (no sample lost or duplicated), `metrics`,
`report` (table, JSONL, plots), `simulate` (discrete-event projection), `cli`. Its own
distribution (clients/april_bench/pyproject.toml); it starts servers with `april_server.launcher`.
"""
