"""A deterministic simulator of the server's core (`make simulate`; docs/operations.md).

The real core code runs on a simulated engine and an in-memory store, under an event loop with
virtual time that picks the next ready callback by a seeded random choice: one seed is one
interleaving of random clients (calls, streams, abandons, retries, answers, aborts, deletes,
resumes, pushes, engine errors), replayed exactly by the command a failure prints.
"""
