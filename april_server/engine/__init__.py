"""The engine side, below any call: what an inference engine must offer and how segments
run on it.

- `base`: `BaseEngine`, `SnapshotEngine`, `SegmentCall`/`SegmentOutcome` (the door's
  SGLang engine and the fleet's remote engines implement them; tests plug in fakes);
- `segment_runner`: `SegmentRunner`, which starts, runs, records and stops segments, with two
  parts of its own: `planner` (`segment_planner.SegmentPlanner`: load, admission, a segment's
  plan) and `weight_cut` (`weight_cut.WeightCut`: what a weight push does to running
  segments: cut, held, replanned);
- `segment_state`: `Running` (one sample generating), `CallTally`, `Counters`, `BACKGROUND`;
- `versions`: `WeightVersions`, the versions served, in order;
- `clock`: where the engine's time goes (`EngineClock`, idle shares)."""
