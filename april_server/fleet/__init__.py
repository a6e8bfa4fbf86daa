"""Many engines behind one rollout manager.

An *engine server* is an april-server (SGLang + our plugin) whose `/april/v1/engine/*` routes
(`engine_routes.py`) expose its engine to a remote caller. The *owner* (`april-server
--april-engines URL,URL`) runs no model: it keeps the quota, the durable buffer and the
policies, and drives the engine servers through `FleetEngine` (`fleet.py`; its weight pushes:
`weight_push.py`), one `RemoteEngine` (`remote.py`) each; `gateway.py` is its HTTP app. The
wire types are in `wire.py`.
"""
