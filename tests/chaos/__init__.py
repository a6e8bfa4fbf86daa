"""The chaos harness (`make chaos`, tests/e2e/test_chaos_e2e.py): random clients against a real
server or an owner over engines, and the ledger that says what was lost, twice or left held."""
