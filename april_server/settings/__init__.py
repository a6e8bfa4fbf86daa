"""Settings, lowest of all: the server's configuration (`config.AprilConfig`) and the
environment variables it hands to SGLang's spawned scheduler (`env`). Imports nothing of ours
but each other."""
