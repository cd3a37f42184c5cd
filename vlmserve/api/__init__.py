"""[loop] The OpenAI-compatible HTTP API: routes, schemas, SSE, errors. No MLX here."""
