"""The OpenAI-compatible APIs: chat completions, completions, responses, models and tokenize
(docs/serving.md §10). Each module is a router with module-level handlers reading ``app.state.ctx``."""
