"""Pure rules: no I/O, no await, no SGLang. Everything that decides, tested alone.

- `samples`: build groups, plan a continuation, record a segment (APRIL's resume semantics);
- `turns`: agent turns (what ends one, when a member awaits input, what an answer does);
- `stops`: how a segment ended, read from what it produced (a stop behind an abort);
- `snapshots`: whether a KV snapshot is usable, kept or dropped;
- `placement`: which engine slot a segment runs on;
- `inflight`: the running-batch size policy and the admission bound;
- `quota`: the batch quota of a call; `idempotency`: `request_id` retries;
- `ranks`: figures of data-parallel ranks merged into one server's."""
