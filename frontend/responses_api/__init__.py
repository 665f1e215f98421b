"""The OpenAI Responses API (`/v1/responses`): a translation onto the chat pipeline, plus a store.

request.py      the request body (pydantic), bounded, every refusal naming its `param`
conversation.py input items <-> stored items <-> chat messages (what the chat template renders)
tools.py        function, namespace, custom and local_shell tools as the chat tools the model is offered
sealing.py      reasoning sealed for the client to carry (include reasoning.encrypted_content), and opened
output.py       a generation's deltas -> output items and the stream's events (one state machine)
events.py       the stream's events and their SSE frames: small pure functions
objects.py      the response object, usage, the list shape of input_items
run.py          one response while it is generated: its events, final object and what is stored of it
service.py      requests made ready to run, background runs and their cancel, the stored responses' endpoints
asgi.py         the HTTP response of a run: SSE or JSON, with the client watched from the first byte
store.py        the stored responses (SQLite / PostgreSQL)
"""
