"""The OpenAI wire types: request bodies, the checks of a whole body before pydantic, reply bodies, the
error shape."""
