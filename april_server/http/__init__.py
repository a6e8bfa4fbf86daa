"""The HTTP surface: the `/april/v1` router over one manager (`app`), the holder that builds
the manager once SGLang runs (`server`), and `/metrics` (`metrics`)."""
