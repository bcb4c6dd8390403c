"""Blocking checks of built output against its contracts."""
