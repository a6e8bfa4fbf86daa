"""The runtime: what lives as long as the server.

- `manager`: `RolloutManager`, which owns the buffer, the segment runner, the live calls and
  the background, and answers `/stats`, `/abort` and deletes;
- `background`: `Background`, groups generating between calls (given the buffer, the segment
  runner and the live-calls map, not the manager);
- `snapshot_sweep`: `SnapshotSweep`, frees KV snapshots nobody refers to;
- `loop_lag`: `LoopLagMonitor`, how late the event loop runs."""
