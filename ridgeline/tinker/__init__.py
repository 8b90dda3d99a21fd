"""The Tinker training API served by Ridgeline (`ridgeline tinker`, docs/tinker.md): `wire` (the
SDK's JSON and protobuf formats), `losses` (its built-in losses on Ridgeline's registered ones),
`futures` (queued work and its polling), `checkpoints` (tinker:// paths on disk), `models` (base
models, training clients, samplers), `service` (the calls), `routes`, `command`."""
