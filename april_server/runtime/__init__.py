"""The runtime: the parts that live as long as the server, below the calls and operations
that use them (the composition root, `root/manager.py`, builds them).

- `background`: `Background`, groups generating between calls;
- `live_calls`: `LiveCalls`, the running calls, recently ended batch ids, request ids in flight;
- `persister`: `Persister`, makes an outcome durable before it is answered;
- `pool_sizing`: `PoolSizing`, the running target, the admission bound and the pool advice;
- `run_to_end`: work that must not stop halfway when its caller goes away;
- `snapshot_sweep`: `SnapshotSweep`, frees KV snapshots nobody refers to;
- `loop_lag`: `LoopLagMonitor`, how late the event loop runs."""
