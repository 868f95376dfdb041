"""Checks of the deployment artefacts under infra/ (no container engine, no cluster needed)."""
