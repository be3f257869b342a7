"""Serving: the continuous-batching `Engine` (rows that join and leave one running batch), the
OpenAI-compatible HTTP server over it (`specdec serve`), its request/response protocol and its
metrics."""
