"""The HTTP edge: the app factory, routes (thin), admin routes, the request middleware (keys, limits,
deadlines, metrics), and rendering of OpenAI responses as JSON and SSE."""
