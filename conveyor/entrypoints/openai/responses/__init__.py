"""OpenAI's Responses API (POST /v1/responses, GET / DELETE /v1/responses/{id}, cancel,
input_items) on conveyor's chat path: protocol.py (request bodies and their translation to a
chat request), output.py (output items and the typed event stream), serving.py (running,
previous_response_id, usage), store.py (the bounded in-memory store), routes.py (the FastAPI
routes). Imports nothing here, so that the CLI reads the store's flags without FastAPI."""
