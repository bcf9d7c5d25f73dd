"""Fixtures for the gateway tests (defined in gateway_fakes.py, which tests also import)."""

from __future__ import annotations

from gateway_fakes import admin_token, gateway_factory, upstream_factory

__all__ = ["admin_token", "gateway_factory", "upstream_factory"]
