"""The dflashd router: one OpenAI/Anthropic-compatible HTTP listener in front of supervised workers.

Modules: `app` (HTTP API), `registry` (workers joining over ZeroMQ, model catalogue, least-loaded
pick), `dispatch` (a request's life: retry, failure after output, cancel), `chat` (templates,
tokenizing, reasoning / tool-call parsing), `anthropic` (Messages API conversion), `schemas`
(request bodies), `supervisor` + `child` (local worker processes), `config`, `metrics`, `cli`
(`dflashd serve`, `dflashd router`), `demo`.
"""
