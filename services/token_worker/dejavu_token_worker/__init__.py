"""DejaVu token worker service."""
