"""Reading answers: tool-call and reasoning parsers."""
