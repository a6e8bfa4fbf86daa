"""The one door to SGLang: only modules in this package import `sglang`.

- `engine.py`: the HTTP-process side (TokenizerManager driver, launcher, KV control client).
- `scheduler_hooks.py`: the scheduler-process side (plugin hooks: snapshot on release, the
  KV control message handler), loaded by SGLang's plugin mechanism in every process.
- `channel.py`: the control operations the first asks of the second, one msgspec struct each
  (no SGLang import); `ipc.py`: the SGLang request types they travel in.
Everything is version-checked against the pinned SGLang.
"""
