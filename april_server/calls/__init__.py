"""The call state machine: one `POST /rollouts` from validation to its persisted answer.

- `rollout`: `rollout()` and `RolloutCall` (steps 1 and the run loop; `request_id` retries);
- `state`: `CallState`, what one call holds;
- `refill`: `Refill`, step 2-3 (start groups whole under the running target, count them);
- `turns_in_call`: `TurnsInCall`, agent turns within a call (events, answers);
- `wind_down`: `WindDown`, steps 4-7 (stop, answer, buffer, persist, hand to the
  background)."""
