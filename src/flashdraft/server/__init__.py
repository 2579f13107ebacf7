"""`flashdraft serve`: an OpenAI- and llama-server-compatible HTTP server with metrics and a web chat page."""
