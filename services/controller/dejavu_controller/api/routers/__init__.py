"""One router per resource: completions, chat, models, health, metrics."""
