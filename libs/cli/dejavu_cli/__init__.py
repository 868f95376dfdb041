"""The ``dejavu`` command line."""
