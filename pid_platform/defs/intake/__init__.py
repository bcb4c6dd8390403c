"""Intake: the sample set of a source (modality intersection, validation, safe keys)."""
