"""The chaos harness (`make chaos`, tests/e2e/test_chaos_e2e.py): random clients against a real
server or an owner over engines, and the ledger that says what was lost, twice or left held.
`harness.py` runs the clients and the drain (and `main`); `client.py` is one client's random
operations; `target.py` launches the server (or the owner and its engines); `ledger.py` keeps
and checks the outcomes."""
