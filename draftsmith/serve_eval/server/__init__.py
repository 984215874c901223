"""OpenAI-compatible HTTP server over the draftsmith engine.

app.py (create_app, ServerConfig) - engine_loop.py (the engine thread) - openai_serving.py
(the /v1 endpoints) - protocol.py (request/response models, errors) - metrics.py + prom.py
(Prometheus) - run.py (`draftsmith serve`) - testing.py (tiny checkpoint, in-process server).
"""
