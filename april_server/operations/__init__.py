"""The other operations on buffered groups, each a function the route calls.

- `resume`: `resume()`, `POST /resume`;
- `inputs`: `post_input()`, `POST /samples/{id}/input` (a tool's answer);
- `groups`: `add_groups()`, `POST /groups` (hand groups in without waiting);
- `abort`: `abort()`, `POST /abort`; `delete`: `delete()`, `DELETE /partials/{id}`."""
