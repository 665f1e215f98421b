"""The OpenAI wire types: request and response schemas, the error shape."""
