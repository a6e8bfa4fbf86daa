"""The runtime: what lives as long as the server.

- `manager`: `RolloutManager`, which owns the buffer, the segment runner, the live calls and
  the background, answers `/stats` and checks every view against the holder map
  (`check_integrity`); abort, delete, resume, answers and `/groups` are in
  `april_server/operations/`;
- `background`: `Background`, groups generating between calls (given the buffer, the segment
  runner and the live-calls map, not the manager);
- `snapshot_sweep`: `SnapshotSweep`, frees KV snapshots nobody refers to;
- `loop_lag`: `LoopLagMonitor`, how late the event loop runs."""
