"""The wire contract's server side (docs/api.md): what crosses HTTP, and nothing else.

- `errors`: `ApiError` and the 400/404/409 builders every route answers with;
- `ids`: what a client-chosen id may look like, and `split_sample_id`;
- `auth`: `AuthPolicy`, who may call the admin routes.
The types themselves (every request, response, event and stored object, msgspec structs) are
not here: they are `april_client.protocol` (clients/april_client/protocol.py), which the
client ships and the server imports, so both sides speak the same structs
(tests/unit/project/test_layers.py counts it in this layer). Nothing in this package imports
torch or SGLang."""
