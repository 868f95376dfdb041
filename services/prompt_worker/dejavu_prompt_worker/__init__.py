"""DejaVu prompt worker service."""
