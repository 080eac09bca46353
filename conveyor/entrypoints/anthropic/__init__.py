"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) on conveyor's chat
path: protocol.py (request bodies and their translation), serving.py (messages and event
streams), errors.py (Anthropic's error shape), routes.py (the FastAPI routes)."""

from conveyor.entrypoints.anthropic.errors import error_response, is_messages_path
from conveyor.entrypoints.anthropic.routes import add_messages_routes

__all__ = ["add_messages_routes", "error_response", "is_messages_path"]
