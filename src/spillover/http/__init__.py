"""HTTP: the app factory, OpenAI schemas, routes and the status page."""
