"""Shared, torch-free building blocks of DejaVu: settings, typed messages, Redis keys, errors."""
