"""Tests of the controller: REST gateway, scheduler, registry, recovery."""
