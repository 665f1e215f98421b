"""What a request asks of the engine and how its answer is read: the chat plan (template tools,
guide, parsers) and the guides made from request fields."""
