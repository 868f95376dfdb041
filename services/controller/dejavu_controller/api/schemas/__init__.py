"""The HTTP wire format (OpenAI-compatible), kept apart from the backend's internal types."""
