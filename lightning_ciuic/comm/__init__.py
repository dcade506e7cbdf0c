"""Gradient communication: synchronizer, codecs, collectives. No Lightning imports."""
