"""The other operations on buffered groups: each a class built by the composition root
(`root/manager.py`) with the parts it uses, called by its route.

- `resume`: `Resume`, `POST /resume`;
- `inputs`: `PostInput`, `POST /samples/{id}/input` (a tool's answer);
- `groups`: `AddGroups`, `POST /groups` (hand groups in without waiting);
- `abort`: `Abort`, `POST /abort`; `delete`: `Delete`, `DELETE /partials/{id}`;
- `partials`: `Partials`, `GET /partials` and `GET /partials/{id}`;
- `lengths`: `ForgetLengths`, `DELETE /lengths`."""
