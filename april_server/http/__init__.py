"""The HTTP surface: the `/april/v1` router over one manager (`app`; a streamed rollout's
NDJSON is `streaming`, the routes' types in /openapi.json `openapi`), the holder that builds
the manager once SGLang runs (`server`), and `/metrics` (`metrics`)."""
