"""DejaVu controller service."""
