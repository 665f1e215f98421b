"""Prometheus metrics and the access log."""
