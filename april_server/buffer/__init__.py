"""The durable partial buffer: who holds each group, and what is on disk.

- `partial_buffer`: `PartialBuffer` and its one holder record per group (`Holder`,
  `resolve`): idle, held by a call, the background, a resume, a delete, an answer;
- `buffer_index`: the idle groups' summaries by age (`BufferIndex`, `BufferEntry`);
- `store`: `BufferStore`, SQLite on its own thread, fsynced before a call is answered;
- `db_thread`: `DbThread`, that thread (SQLite work off the event loop, in submission order);
- `synthetic`: big synthetic buffers for the scale benchmark and tests."""
