"""Many engines behind one rollout manager.

An *engine server* is an april-server (SGLang + our plugin) whose `/april/v1/engine/*` routes
(`engine_routes.py`) expose its engine to a remote caller. The *owner* (`april-server
--april-engines URL,URL`) runs no model: it keeps the quota, the durable buffer and the
policies, and drives the engine servers through `FleetEngine` (`fleet.py`), one `RemoteEngine`
(`remote.py`) each. The fleet holds its weight push as a part (`weights`: `weight_push.py`),
which the weight-update group (`weight_group.py`) is handed; `gateway.py` is its HTTP app. The
wire types are in `wire.py`.
"""
