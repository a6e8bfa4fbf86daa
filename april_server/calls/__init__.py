"""The call state machine: one `POST /rollouts` from validation to its persisted answer.

- `rollout`: `Rollout` (the route's entry: `request_id` retries) and `RolloutCall` (one call:
  step 2 and the run loop, over the parts below; the steps are docs/architecture.md's lifecycle);
- `state`: `CallState`, what one call holds (plain data);
- `parts`: `CallParts`, the collaborators a call is handed;
- `new_groups`: validate and build sent groups (also for `POST /groups`);
- `refill`: `Refill`, steps 3-6 (size the running set, start groups whole, count them);
- `turns_in_call`: `TurnsInCall`, agent turns within a call (events, answers);
- `wind_down`: `WindDown`, steps 7-10 (stop, answer, buffer, persist, hand to the
  background)."""
