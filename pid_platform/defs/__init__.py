"""Dagster definitions, one folder per domain; each module registers its own definitions."""
