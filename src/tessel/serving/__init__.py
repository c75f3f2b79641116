"""The serving engine (`engine.Engine`) and `tessel serve`'s OpenAI-compatible HTTP server over it."""
