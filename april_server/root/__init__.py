"""The composition root: `RolloutManager` builds the server's parts, wires each to the parts
it uses, and offers the operations the routes call; it holds no logic of its own beyond the
views over all parts (`/stats`, `check_integrity`)."""
