"""The wire contract (docs/api.md): what crosses HTTP, and nothing else.

- `protocol`: every request, response, event and stored object (msgspec structs);
- `errors`: `ApiError` and the 400/404/409 builders every route answers with;
- `ids`: what a client-chosen id may look like;
- `auth`: `AuthPolicy`, who may call the admin routes.
The client package imports `protocol` from here, so nothing in this package imports torch or
SGLang."""
